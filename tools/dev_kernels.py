"""Build some csrc/ kernels alone into a development module, for fast kernel work.

    python tools/dev_kernels.py NAME csrc/a.cpp [csrc/b.cpp ...]

compiles ``csrc/module.cpp`` plus the given files (ninja, incremental) into
``/tmp/tokenserve_dev_NAME/_C_NAME.so`` and prints that path; then

    TOKENSERVE_KERNELS_SO=/tmp/tokenserve_dev_NAME/_C_NAME.so python -m pytest tests/unit/...

runs tests against it (``tokenserve.ops.dispatch.load_kernels`` loads it instead of
``tokenserve._C``). The package build (``setup.py``) uses the same flags.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.utils.cpp_extension as ext

FLAGS = ["-O3", "-std=c++20", "-fno-math-errno", "-Wno-unused-function", "-fopenmp", "-g0"]


def main() -> None:
    name, files = sys.argv[1], sys.argv[2:]
    root = Path(__file__).resolve().parents[1]
    out = Path(f"/tmp/tokenserve_dev_{name}")
    out.mkdir(exist_ok=True)
    mod = ext.load(name=f"_C_{name}", build_directory=str(out), extra_cflags=FLAGS,
                   sources=[str(root / "csrc/module.cpp")] + [str(root / f) for f in files],
                   extra_include_paths=[str(root / "csrc")], extra_ldflags=["-fopenmp", "-g0"],
                   verbose=bool(os.environ.get("V")))
    print(mod.__file__)


if __name__ == "__main__":
    main()
