"""Kernel micro-benchmarks: ``python -m bench.kernels`` (or ``tokenserve bench kernels``).

Imports every ``bench/kernels_*.py`` module present, calls its ``bench() -> list[dict]``
and prints one table per module, after a header with the CPU (``lscpu`` model name and
the ISA flags that matter here: avx2, avx512f, avx512_bf16, amx) and the ``uptime`` load
(the numbers mean little when other work shares the cores)::

    kernels_gemm.py       bench() -> [{"name": "linear bf16", "shape": "M=1 K=576 N=1536",
    kernels_attention.py              "ours_ms": 0.041, "ref_ms": 0.093}, ...]
    kernels_layer.py
    kernels_sampling.py

A row is a dict. Recognised keys (first one present wins):

- name: ``name``, ``op``, ``kernel``, ``case``
- shape: ``shape`` (a string, or a tuple/list/dict, formatted), else the dimension keys
  present (``batch``, ``T``, ``M``, ``N``, ``K``, ``vocab``, ..., ``dtype``)
- ours ms: ``ours_ms``, ``ms_ours``, ``cpp_ms``, ``kernel_ms``, ``ours``, ``ms``, or a
  ``*_us`` twin (microseconds, shown in ms)
- reference ms: the time column the module's own ``speedup``/``ratio`` was computed from
  (when one matches), else ``ref_ms``, ``ms_ref``, ``reference_ms``, ``torch_ms``,
  ``ms_torch``, ``ms_torch_fp32``, ``ms_torch_bf16``, ``reference``, ``ref``, ``ref_us``,
  else the first other ``ms_*``/``*_ms``/``*_us`` number (a string ``ref`` is a name)
- ratio: reference ms / ours ms from the two columns shown (> 1: ours is faster, as the
  modules' own ``speedup``/``ratio``, which is shown only when it disagrees)

Any other keys (the other reference's time, ``gflops_ours``, ``note``, ...) are printed in
the last column as ``key=value`` (None values left out). A module that is missing, fails to import, raises in ``bench()`` or returns
something else than a list of dicts is reported in place of its table; the others still
run. Exit status 0, or 1 with ``--strict`` when a module failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenserve.loadgen import server

HERE = Path(__file__).resolve().parent
#: the modules the kernel work is expected to provide (reported when absent)
EXPECTED = ("gemm", "attention", "layer", "sampling")
#: ISA flags summarised in the header (lscpu/cpuinfo spelling)
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")

_NAME = ("name", "op", "kernel", "case")
#: ours' time; ``*_us`` keys are microseconds (shown in ms)
_OURS = ("ours_ms", "ms_ours", "cpp_ms", "kernel_ms", "ours", "ms", "ours_us", "us_ours",
         "cpp_us", "kernel_us")
_REF = ("ref_ms", "ms_ref", "reference_ms", "ms_reference", "torch_ms", "ms_torch",
        "ms_torch_fp32", "ms_torch_bf16", "reference", "ref", "ref_us", "us_ref")
#: the module's own reference / ours (its pairing is used when it matches a time column)
_GIVEN_RATIO = ("speedup", "ratio")
#: dimension keys that make up the shape when a row has no ``shape``
_DIMS = ("batch", "B", "T", "M", "N", "K", "L", "q_len", "ctx", "vocab", "H", "Hkv", "D",
         "dtype")
_HEAD = ("name", "shape", "ours ms", "ref ms", "ratio", "notes")


# --------------------------------------------------------------------------- discovery


def discover(root: Path | None = None) -> list[str]:
    """Short names (``gemm`` for ``kernels_gemm.py``) of the kernel modules present in
    ``root`` (default: this package)."""
    return sorted(p.stem[len("kernels_"):] for p in (root or HERE).glob("kernels_*.py"))


def run_module(short: str) -> tuple[list[dict[str, Any]] | None, str | None, float]:
    """Import ``bench.kernels_<short>`` and call its ``bench()``.

    Returns ``(rows, error, seconds)``: rows is None when it failed, error says why.
    """
    t0 = time.perf_counter()
    try:
        mod = importlib.import_module(f"bench.kernels_{short}")
        fn = getattr(mod, "bench", None)
        if not callable(fn):
            return None, "no bench() function", time.perf_counter() - t0
        rows = fn()
    except Exception as exc:  # noqa: BLE001 (any failure is reported, not fatal)
        where = traceback.extract_tb(exc.__traceback__)[-1:]
        loc = f" ({Path(where[0].filename).name}:{where[0].lineno})" if where else ""
        return None, f"{type(exc).__name__}: {exc}{loc}", time.perf_counter() - t0
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return None, f"bench() returned {type(rows).__name__}, not a list of dicts", \
            time.perf_counter() - t0
    return rows, None, time.perf_counter() - t0


# --------------------------------------------------------------------------- formatting


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return None if math.isnan(x) else float(x)


def _first(row: dict[str, Any], keys: Sequence[str], numeric: bool) -> tuple[Any, str | None]:
    """The first of ``keys`` in ``row`` (a number, when ``numeric``; ``None`` values count
    as present, so a missing time shows as ``-`` and is not replaced by another key)."""
    for k in keys:
        if k in row and (not numeric or row[k] is None or _num(row[k]) is not None):
            return row[k], k
    return None, None


def _scale(key: str) -> float:
    """ms per unit of a time key (``*_us``/``us_*``: microseconds)."""
    return 1e-3 if key.endswith("_us") or key.startswith("us_") else 1.0


def _is_time(key: str) -> bool:
    return any(key.startswith(p) or key.endswith(q)
               for p, q in (("ms_", "_ms"), ("us_", "_us")))


def _ms(row: dict[str, Any], key: str | None) -> float | None:
    v = _num(row.get(key)) if key else None
    return None if v is None else v * _scale(key)


def _ref_key(row: dict[str, Any], ours_key: str | None) -> str | None:
    """The reference column: the one the module's own ``speedup``/``ratio`` was computed
    from (when one matches), else the first of :data:`_REF`, else the first other time."""
    cands = [k for k, v in row.items()
             if k != ours_key and (_is_time(k) or k in _REF) and _num(v) is not None]
    ours = _ms(row, ours_key)
    given = next((_num(row[k]) for k in _GIVEN_RATIO if _num(row.get(k)) is not None), None)
    if ours and given:
        for k in cands:
            if math.isclose(_ms(row, k) / ours, given, rel_tol=0.02, abs_tol=0.006):
                return k
    for k in _REF:
        if k in cands:
            return k
    return cands[0] if cands else None
def format_shape(shape: Any) -> str:
    if shape is None:
        return "-"
    if isinstance(shape, dict):
        return " ".join(f"{k}={v}" for k, v in shape.items())
    if isinstance(shape, (list, tuple)):
        return "x".join("-" if v is None else str(v) for v in shape)
    return str(shape)


def format_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.3f}" if ms < 10 else f"{ms:.1f}" if ms < 1000 else f"{ms:.0f}"


def table_row(row: dict[str, Any]) -> tuple[str, ...]:
    """One table line's cells: name, shape, ours ms, reference ms, ratio, notes."""
    name, name_key = _first(row, _NAME, numeric=False)
    _, ours_key = _first(row, _OURS, numeric=True)
    ref_key = _ref_key(row, ours_key)
    ours, ref = _ms(row, ours_key), _ms(row, ref_key)
    ratio = ref / ours if ours and ref is not None else None
    if "shape" in row:
        shape, shape_keys = format_shape(row["shape"]), {"shape"}
    else:
        shape_keys = {k for k in _DIMS if k in row}
        shape = format_shape({k: row[k] for k in _DIMS if k in row} or None)
    used = {name_key, ours_key, ref_key, *shape_keys}
    for k in _GIVEN_RATIO:  # the module's own ratio: shown only when it says something else
        given = _num(row.get(k))
        if given is None or (ratio is not None and math.isclose(given, ratio, rel_tol=0.02,
                                                                abs_tol=0.006)):
            used.add(k)
    notes = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
             for k, v in row.items() if k not in used and v is not None]
    if ref_key is not None and ref_key not in ("ref_ms", "reference_ms", "ref", "reference"):
        notes.insert(0, f"ref:{ref_key}")
    return (str(name) if name is not None else "?", shape, format_ms(ours), format_ms(ref),
            "-" if ratio is None else f"x{ratio:.2f}", " ".join(notes))


def format_table(module: str, rows: Sequence[dict[str, Any]] | None, error: str | None = None,
                 seconds: float | None = None) -> str:
    """A module's fixed-width table, or the line that says why there is none."""
    took = f" ({seconds:.1f} s)" if seconds is not None else ""
    title = f"== kernels_{module}{took}"
    if error is not None:
        return f"{title}: FAILED: {error}"
    if not rows:
        return f"{title}: no rows"
    cells = [_HEAD, *(table_row(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(_HEAD))]
    lines = [title]
    for k, c in enumerate(cells):
        lines.append("  ".join(v.ljust(w) if i in (0, 1, 5) else v.rjust(w)
                               for i, (v, w) in enumerate(zip(c, widths))).rstrip())
        if k == 0:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- machine


def parse_lscpu(text: str) -> dict[str, Any]:
    """Model name, CPU count and the :data:`FLAGS` present, from ``lscpu`` (or
    ``/proc/cpuinfo``) text (:func:`tokenserve.loadgen.server.parse_lscpu`)."""
    return server.parse_lscpu(text, FLAGS)


def parse_load(uptime_text: str) -> str | None:
    """``1.23, 0.98, 0.50`` from ``uptime`` output."""
    m = re.search(r"load averages?:\s*(.+)$", uptime_text.strip())
    return m.group(1).strip() if m else None


def _run(cmd: Sequence[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return ""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10,
                              env={**os.environ, "LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_info() -> dict[str, Any]:
    info = parse_lscpu(server.lscpu_text())
    load = parse_load(_run(["uptime"]))
    if load is None and hasattr(os, "getloadavg"):
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    info["load"] = load
    try:
        info["nproc"] = len(os.sched_getaffinity(0))
    except AttributeError:
        info["nproc"] = os.cpu_count()
    try:
        import torch

        info["torch"] = f"{torch.__version__}, {torch.get_num_threads()} threads"
    except ImportError:
        info["torch"] = None
    return info


def format_header(info: dict[str, Any]) -> str:
    flags = " ".join(f"{f}{'+' if on else '-'}" for f, on in info["flags"].items())
    lines = [f"CPU: {info.get('model') or '?'} ({info.get('cpus') or '?'} CPUs, nproc "
             f"{info.get('nproc') or '?'})",
             f"ISA: {flags}",
             f"load average (1/5/15 min): {info.get('load') or '?'}"
             + ("  [> nproc: other work shares the cores, times are inflated]"
                if _busy(info) else "")]
    if info.get("torch"):
        lines.append(f"torch {info['torch']}")
    lines.append("ratio = reference ms / ours ms (> 1: ours is faster)")
    return "\n".join(lines)


def _busy(info: dict[str, Any]) -> bool:
    try:
        one = float(str(info.get("load")).split(",")[0])
    except ValueError:
        return False
    return bool(info.get("nproc")) and one > info["nproc"]


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kernels",
                                description="Kernel micro-benchmarks: every bench/kernels_*.py")
    p.add_argument("modules", nargs="*",
                   help="short names to run (gemm attention ...); default: all present")
    p.add_argument("--json", default=None, help="also write machine info and rows here")
    p.add_argument("--strict", action="store_true", help="exit 1 when a module failed")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    if str(HERE.parent) not in sys.path:  # `python bench/kernels.py` from anywhere
        sys.path.insert(0, str(HERE.parent))
    info = machine_info()
    print(format_header(info), flush=True)
    present = discover()
    wanted = args.modules or present
    missing = [m for m in (args.modules or EXPECTED) if m not in present]
    if missing:
        print("not present: " + ", ".join(f"kernels_{m}.py" for m in missing), flush=True)
    doc: dict[str, Any] = {"machine": info, "modules": {}}
    failed = 0
    for short in wanted:
        if short not in present:
            continue
        rows, error, seconds = run_module(short)
        failed += error is not None
        print("\n" + format_table(short, rows, error, seconds), flush=True)
        doc["modules"][short] = {"rows": rows, "error": error, "seconds": seconds}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        print(f"\nwrote {args.json}")
    return 1 if failed and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
