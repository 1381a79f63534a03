"""Builds csrc/ into the optional extension ``tokenserve._C`` (pybind11).

The engine runs without it (pure-torch references in ``tokenserve/ops``); a failed
build is reported and skipped so the pure-Python package still installs.
"""

from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

sources = sorted(str(p) for p in Path("csrc").glob("*.cpp"))


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - a missing compiler must not block install
            print(f"warning: tokenserve._C not built ({exc}); using the torch reference ops")


ext_modules = [
    Pybind11Extension("tokenserve._C", sources, cxx_std=17, extra_compile_args=["-O3"]),
] if sources else []

setup(ext_modules=ext_modules, cmdclass={"build_ext": OptionalBuildExt})
