"""Builds csrc/ into the optional extension ``tokenserve._C`` (torch C++ extension, pybind11).

Kernels pick their code path (AVX2+FMA, portable) at run time by CPU feature
(csrc/cpu_features.h), so one build serves every x86-64 machine. Threads come from
ATen's ``at::parallel_for``, whose OpenMP implementation is inlined from torch's headers:
it is parallel only when the extension is compiled with ``-fopenmp`` (without it every
kernel silently runs on one thread). At run time ``libgomp.so.1`` resolves to the copy
torch has already loaded, so there is one OpenMP runtime and one thread count. The engine runs without the extension (pure-torch references
in ``tokenserve/ops``); a failed build is reported and skipped so the package still
installs. Build with ``pip install --no-build-isolation -e .`` (it needs the installed
torch's headers).

One compile per checkout: the objects live in ``build/temp`` (not pip's throw-away
temporary folder), and ninja compiles the csrc/ files in parallel and, on a later install
(``pip install -e '.[test]'`` after ``pip install -e .``), only those whose sources or
headers changed; the link is all that runs again. ``-g0`` drops the debug information
Python's default flags ask for (it doubled the compile time and the .so's size).
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sources = sorted(str(p) for p in Path("csrc").glob("*.cpp"))

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # torch not installed yet: install the pure-Python package
    BuildExtension, CppExtension = None, None


def _ext_modules():
    if CppExtension is None or not sources:
        return []
    return [CppExtension(
        "tokenserve._C", sources,
        extra_compile_args=["-O3", "-std=c++20", "-fno-math-errno", "-Wno-unused-function",
                            "-fopenmp", "-g0"],
        extra_link_args=["-fopenmp"],
    )]


def _cmdclass():
    if BuildExtension is None:
        return {}

    class OptionalBuildExt(BuildExtension):
        def run(self):
            # a persistent object folder: ninja rebuilds only what changed (see above)
            self.build_temp = str(ROOT / "build" / "temp")
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - a missing compiler must not block install
                print(f"warning: tokenserve._C not built ({exc}); using the torch reference ops")

    return {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


setup(ext_modules=_ext_modules(), cmdclass=_cmdclass())
