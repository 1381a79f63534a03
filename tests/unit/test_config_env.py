"""Every environment variable the program reads is in ``tokenserve.config.env``'s table and
read there: no other module looks one up by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tokenserve.config import env

ROOT = Path(__file__).resolve().parents[2]
#: a lookup of a named variable: os.environ.get("X"), os.environ["X"], os.getenv("X"),
#: std::getenv("X")
LOOKUP = re.compile(r"""(?:environ\.get|environ\[|getenv)\(?\s*["']([A-Z_][A-Z0-9_]*)["']""")


def _lookups(paths: list[Path]) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for p in paths:
        for name in LOOKUP.findall(p.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    return found


def test_only_config_env_reads_the_environment() -> None:
    py = [p for p in (ROOT / "tokenserve").rglob("*.py")]
    found = _lookups(py)
    outside = {n: f for n, f in found.items() if f != {"tokenserve/config/env.py"}}
    assert not outside, f"read the environment through tokenserve.config.env: {outside}"
    assert set(found) <= set(env.VARS)


def test_the_table_lists_what_the_cpp_reads() -> None:
    cpp = list((ROOT / "csrc").rglob("*.cpp")) + list((ROOT / "csrc").rglob("*.h"))
    assert set(_lookups(cpp)) <= set(env.VARS)


@pytest.mark.parametrize(("value", "gemm", "off", "fused"), [
    (None, "", False, True), ("", "", False, True), ("0", "0", False, False),
    ("1", "1", True, True)])
def test_readers_read_at_call_time(monkeypatch, value, gemm, off, fused) -> None:
    for name in ("TOKENSERVE_GEMM", "TOKENSERVE_DISABLE_C", "TOKENSERVE_FUSED_DECODER"):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert (env.gemm(), env.disable_c(), env.fused_decoder()) == (gemm, off, fused)
