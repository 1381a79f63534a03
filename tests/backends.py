"""The weight paths (GEMM backends) the dispatcher can choose on some CPU, for tests that
must hold on each of them: every batch-invariance, chunked-prefill and prefix-cache
equality test runs once per path (issue 20), so a change that breaks one CPU kind's path
fails on every machine that can run it, and a path this CPU cannot run is skipped with
the reason.

Each entry: ``(test id, TOKENSERVE_GEMM value, quantization, why this CPU cannot run it
or None)``. ``oneDNN`` is not here: it is opt-in and not batch-invariant
(``tokenserve/ops/linear.py``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import amx_available, quant_isa


def _features() -> dict[str, bool]:
    c = load_kernels()
    return {} if c is None or not hasattr(c, "cpu_features") else dict(c.cpu_features())


def weight_paths() -> list:
    """pytest params, one per weight path, with ``skip`` marks where this CPU lacks it."""
    f = _features()
    built = bool(f)
    amx = built and amx_available(load_kernels())
    paths = [
        ("bf16-avx512bf16", "c", "none",
         None if f.get("avx512bf16") else "bf16 pair-dot GEMM: this CPU has no AVX512_BF16"
         if built else "tokenserve._C not built"),
        ("bf16-fma", "c-fma", "none", None if built else "tokenserve._C not built"),
        # the block GEMM's AVX-512 VNNI, AVX2 and AMX-INT8 tiles give the same bits (unit
        # tests: tests/unit/test_kernel_quant.py, test_kernel_quant_amx_int.py), so the id
        # names the ones this CPU runs: alone on the VNNI/AVX2 tiles, 16+ rows on AMX-INT8
        (f"gguf-{quant_isa(load_kernels()).replace('+amx_int8', '-amxint8')}", "c", "gguf",
         None if built else "tokenserve._C not built"),
        ("gguf-amx-bf16", "amx-bf16", "gguf",
         None if amx else "AMX-BF16 block GEMM: this CPU (or OS) has no AMX-BF16 tiles"
         if built else "tokenserve._C not built"),
    ]
    return [pytest.param((gemm, quant), id=name,
                         marks=[pytest.mark.skip(reason=why)] if why else [])
            for name, gemm, quant, why in paths]


@contextmanager
def gemm_env(gemm: str):
    """``TOKENSERVE_GEMM=gemm`` while the model's layers are built (Linear reads it then)."""
    old = os.environ.get("TOKENSERVE_GEMM")
    os.environ["TOKENSERVE_GEMM"] = gemm
    try:
        yield
    finally:
        if old is None:
            del os.environ["TOKENSERVE_GEMM"]
        else:
            os.environ["TOKENSERVE_GEMM"] = old
