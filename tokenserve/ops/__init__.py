"""Kernels: the C++ extension ``tokenserve._C`` when it is built, else pure-torch references.

:func:`load_kernels` imports the extension once per call site that asks (cheap after the
first import) and says why it is absent. Set ``TOKENSERVE_DISABLE_C=1`` to run on the
references alone (what the "with and without ``_C``" tests compare), or
``TOKENSERVE_KERNELS_SO=path`` to load a development build of some kernels
(``tools/dev_kernels.py``) in its place.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger("tokenserve.ops")


def load_kernels() -> ModuleType | None:
    """``tokenserve._C``, or None when it is disabled (``TOKENSERVE_DISABLE_C=1``), not
    built, or built against another ABI.

    Returns:
        the extension module (its ``cpu_features()`` says which code paths run), or None.
    """
    if os.environ.get("TOKENSERVE_DISABLE_C", "") not in ("", "0"):
        return None
    import torch  # noqa: F401 - loads libc10/libtorch, which the extension links to

    try:
        if dev := os.environ.get("TOKENSERVE_KERNELS_SO"):  # a tools/dev_kernels.py build
            name = Path(dev).name.split(".")[0]
            mod = sys.modules.get(name)
            if mod is None:
                spec = importlib.util.spec_from_file_location(name, dev)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                sys.modules[name] = mod
        else:
            mod = importlib.import_module("tokenserve._C")
    except ImportError:
        return None
    return mod if getattr(mod, "ABI_VERSION", None) == 2 else None
