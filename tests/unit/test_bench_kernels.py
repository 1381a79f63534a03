"""``bench/kernels.py``: table formatting, key aliases, the machine header, and that a
missing or failing ``kernels_*.py`` module is reported without stopping the others (fake
modules in a temporary package; nothing is timed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import kernels

ROWS = [
    {"name": "linear bf16", "shape": "M=1 K=576 N=1536", "ours_ms": 0.0412, "ref_ms": 0.0824},
    {"op": "rmsnorm", "shape": (64, 576), "ms": 12.34, "torch_ms": 6.17, "ref": "torch",
     "gflops": 1.23456},
    {"kernel": "paged decode", "shape": {"B": 16, "ctx": 160}, "ours": 1500.0},
    # kernels_gemm.py's schema: two torch references, its own ratio (not shown)
    {"name": "qkv", "shape": (16, 960, 576), "ms_ours": 0.5, "ms_torch_bf16": 9.0,
     "ms_torch_fp32": 1.0, "ratio": 2.0, "gflops_ours": 35.4},
    {"name": "step", "shape": (16, None, None), "ms_ours": None, "ms_torch_fp32": 3.0},
]


def test_rows_use_the_aliases_and_compute_the_ratio():
    assert kernels.table_row(ROWS[0]) == ("linear bf16", "M=1 K=576 N=1536", "0.041", "0.082",
                                          "x2.00", "")
    # `ref` is a string here (the reference's name): a note, not the time
    assert kernels.table_row(ROWS[1]) == ("rmsnorm", "64x576", "12.3", "6.170", "x0.50",
                                          "ref:torch_ms ref=torch gflops=1.235")
    assert kernels.table_row(ROWS[2]) == ("paged decode", "B=16 ctx=160", "1500", "-", "-", "")
    assert kernels.table_row(ROWS[3]) == ("qkv", "16x960x576", "0.500", "1.000", "x2.00",
                                          "ref:ms_torch_fp32 ms_torch_bf16=9 "
                                          "gflops_ours=35.4")
    # no time for ours (the extension is not built): no ratio, the reference still shown
    assert kernels.table_row(ROWS[4]) == ("step", "16x-x-", "-", "3.000", "-",
                                          "ref:ms_torch_fp32")
    # any other *_ms key is the reference when none of the usual names is there
    assert kernels.table_row({"name": "a", "ours_ms": 2.0, "onednn_ms": 3.0})[3:5] == \
        ("3.000", "x1.50")
    assert kernels.table_row({}) == ("?", "-", "-", "-", "-", "")


def test_the_schemas_of_the_kernel_modules():
    # kernels_attention.py: the reference is the column its own `speedup` came from
    assert kernels.table_row(
        {"name": "decode", "shape": "batch=16 ctx=160", "ms_gather_sdpa": 2.0,
         "ms_gather_sdpa_fp32": 1.0, "ms_ours": 0.5, "speedup": 4.0, "speedup_vs_fp32": 2.0}
    ) == ("decode", "batch=16 ctx=160", "0.500", "2.000", "x4.00",
          "ref:ms_gather_sdpa ms_gather_sdpa_fp32=1 speedup_vs_fp32=2")
    # kernels_layer.py: microseconds, no `shape` (made of the dimension keys)
    assert kernels.table_row(
        {"kernel": "rms_norm", "T": 64, "dtype": "bfloat16", "kernel_us": 12.0, "ref_us": 48.0,
         "speedup": 4.0}) == ("rms_norm", "T=64 dtype=bfloat16", "0.012", "0.048", "x4.00",
                              "ref:ref_us")
    # kernels_sampling.py: `case`, `cpp_ms`; no extension: None times and ratio
    assert kernels.table_row(
        {"case": "greedy", "batch": 64, "vocab": 49152, "ref_ms": 3.0, "cpp_ms": None,
         "speedup": None, "same_tokens": None}) == ("greedy", "batch=64 vocab=49152", "-",
                                                    "3.000", "-", "")
    # a module ratio that disagrees with the columns shown is kept as a note
    assert kernels.table_row({"name": "x", "ms_ours": 1.0, "ref_ms": 2.0, "speedup": 5.0}
                             )[4:] == ("x2.00", "speedup=5")


def test_table_is_aligned_with_a_header_and_title():
    text = kernels.format_table("gemm", ROWS, seconds=1.25)
    lines = text.splitlines()
    assert lines[0] == "== kernels_gemm (1.2 s)"
    assert lines[1].split() == ["name", "shape", "ours", "ms", "ref", "ms", "ratio", "notes"]
    assert set(lines[2]) == {"-"}
    assert len(lines) == 3 + len(ROWS)
    # numbers are right-aligned: the ours-ms column ends at the same place in every row
    assert lines[3].index("0.041") + 5 == lines[4].index("12.3") + 4 == lines[5].index("1500") + 4
    assert "x2.00" in lines[3] and "x0.50" in lines[4]


def test_failures_and_empty_modules_are_one_line():
    assert kernels.format_table("attention", None, "ImportError: no _C") == \
        "== kernels_attention: FAILED: ImportError: no _C"
    assert kernels.format_table("layer", []) == "== kernels_layer: no rows"


def test_lscpu_flags_and_load():
    text = ("Architecture:  x86_64\nCPU(s):  2\nModel name:  Intel(R) Xeon(R) Platinum 8481C\n"
            "Flags:  fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    info = kernels.parse_lscpu(text)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8481C" and info["cpus"] == "2"
    assert info["flags"] == {"avx2": True, "avx512f": True, "avx512_bf16": True,
                             "avx512_vnni": False, "amx_tile": True, "amx_bf16": True,
                             "amx_int8": False}
    assert kernels.parse_load(" 07:44:02 up 14 min,  0 user,  load average: 3.13, 1.35, 0.68\n") \
        == "3.13, 1.35, 0.68"
    assert kernels.parse_load("garbage") is None
    head = kernels.format_header({**info, "load": "3.13, 1.35, 0.68", "nproc": 2,
                                  "torch": None})
    assert "CPU: Intel(R) Xeon(R) Platinum 8481C (2 CPUs, nproc 2)" in head
    assert "avx512_bf16+" in head and "amx_int8-" in head
    assert "3.13, 1.35, 0.68  [> nproc" in head


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """A throwaway ``bench`` package with three kernel modules: one good, one raising in
    bench(), one that does not import; ``bench.kernels`` pointed at it."""
    pkg = tmp_path / "bench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels_gemm.py").write_text(
        "def bench():\n    return [{'name': 'mm', 'shape': [1, 2], 'ours_ms': 1.0, "
        "'ref_ms': 4.0}]\n")
    (pkg / "kernels_layer.py").write_text("def bench():\n    raise RuntimeError('boom')\n")
    (pkg / "kernels_sampling.py").write_text("import no_such_module_here\n")
    saved = {k: v for k, v in sys.modules.items() if k == "bench" or k.startswith("bench.")}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(str(tmp_path))
    import bench as fake

    assert Path(fake.__file__).parent == pkg
    monkeypatch.setattr(kernels, "HERE", pkg)
    monkeypatch.setattr(kernels, "machine_info", lambda: {
        "model": "Fake CPU", "cpus": "2", "flags": {f: False for f in kernels.FLAGS},
        "load": "0.10, 0.20, 0.30", "nproc": 2, "torch": None})
    yield pkg
    for k in [k for k in sys.modules if k == "bench" or k.startswith("bench.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def test_main_reports_missing_and_failing_modules(fake_bench, tmp_path, capsys):
    assert kernels.discover() == ["gemm", "layer", "sampling"]
    out_json = tmp_path / "k.json"
    assert kernels.main(["--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: Fake CPU (2 CPUs, nproc 2)\nISA: avx2- ")
    assert "load average (1/5/15 min): 0.10, 0.20, 0.30" in out
    assert "not present: kernels_attention.py" in out
    assert "== kernels_gemm" in out and "x4.00" in out
    assert "== kernels_layer" in out and "FAILED: RuntimeError: boom (kernels_layer.py:2)" in out
    assert "FAILED: ModuleNotFoundError" in out and "no_such_module_here" in out
    assert out_json.is_file()
    assert kernels.main(["--strict", "gemm"]) == 0
    assert kernels.main(["--strict", "layer"]) == 1
