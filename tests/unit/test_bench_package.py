"""``tokenserve.loadgen`` is part of the installed package: its data files are package data,
and it never imports ``tokenserve.cli`` (the CLI imports it, lazily, in ``tokenserve bench``)."""

from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path

import pytest

import tokenserve.loadgen

ROOT = Path(__file__).resolve().parents[2]
PKG = Path(tokenserve.loadgen.__file__).parent


def test_data_files_are_package_data():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from tokenserve.loadgen.workload import PASSAGES

    assert PASSAGES.parent == PKG and PASSAGES.is_file()
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = conf["tool"]["setuptools"]["package-data"]["tokenserve.loadgen"]
    data = [p for p in PKG.iterdir() if p.is_file() and p.suffix != ".py"]
    assert data
    for p in data:
        assert any(fnmatch.fnmatch(p.name, pat) for pat in patterns), p.name


def test_no_module_imports_the_cli():
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any(n == "tokenserve.cli" or n.startswith("bench") for n in names), (
                path.name, names)


def test_engine_config_leaves_the_cli_unimported(monkeypatch):
    for name in [m for m in sys.modules if m == "tokenserve.cli"]:
        monkeypatch.delitem(sys.modules, name)
    from tokenserve.loadgen.serving import build_parser, engine_config

    args = build_parser().parse_args(["--engine-only", "--dtype", "float32",
                                      "--server-args", "--max-batch-size 3"])
    cfg = engine_config(args)
    assert (cfg.dtype, cfg.max_batch_size) == ("float32", 3)
    assert "tokenserve.cli" not in sys.modules
