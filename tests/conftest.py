"""Session-wide checks.

In CI (``CI`` set, as ``.ci/run`` runs) the C++ extension must be built: the kernel tests
skip without it, and that must never happen silently there.
"""

from __future__ import annotations

import os

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get("CI") and not os.environ.get("TOKENSERVE_DISABLE_C"):
        from tokenserve.ops.dispatch import load_kernels

        if load_kernels() is None:
            raise pytest.UsageError(
                "CI: tokenserve._C is not built (see the install log for the compiler "
                "error); the kernel tests would skip")
