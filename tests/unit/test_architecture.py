"""The architecture as tests: the import contracts of pyproject.toml (layers, the
coordinator apart from the server and engine, the transport apart from the API, no cycles)
and the one route table (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess

import pytest

from tokenserve.api import routes
from tokenserve.api.routes import ROUTES, Coord, Family, Stream

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tokenserve"


def test_import_contracts_hold() -> None:
    exe = shutil.which("lint-imports")
    assert exe is not None, "import-linter is a test dependency (pip install -e '.[test]')"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _string_constants(path: pathlib.Path) -> set[str]:
    """Every string literal of a module except docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                                | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings}


def test_route_paths_are_written_only_in_the_table() -> None:
    """No module but api/routes.py spells a route's path (the bench client included):
    they all read the table."""
    paths = {r.path for r in ROUTES if r.path != "/"}
    suffixes = {"/" + r.path.rsplit("/", 1)[-1] for r in ROUTES if "{" in r.path}
    offenders = []
    for path in sorted([*PACKAGE.rglob("*.py")]):
        if path.name == "routes.py" and path.parent.name == "api":
            continue
        found = _string_constants(path) & (paths | suffixes)
        if found:
            offenders.append(f"{path.relative_to(ROOT)}: {sorted(found)}")
    assert not offenders, "\n".join(offenders)


def test_the_table_is_consistent() -> None:
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)
    for r in routes.INFERENCE:
        assert r.method == "POST" and r.coordinator is Coord.RELAY
        assert r.prompt is not None or r.family is Family.GENERATE
    assert {r.path for r in routes.INFERENCE} == {
        "/infer", "/infer_token", "/generate", "/generate_stream", "/",
        "/v1/chat/completions", "/v1/completions", "/v2/models/{model}/infer",
        "/v2/models/{model}/generate", "/v2/models/{model}/generate_stream"}


@pytest.mark.parametrize(("path", "body", "family", "stream", "prompt"), [
    ("/infer", {"inputs": "x", "stream": True}, Family.MINDIE, True, "inputs"),
    ("/infer_token", {"input_id": [1]}, Family.MINDIE, False, "inputs"),
    ("/generate", {"prompt": "x", "inputs": "y", "stream": True}, Family.VLLM, True, "prompt"),
    ("/generate", {"inputs": "y", "stream": True}, Family.TGI, False, "inputs"),
    ("/generate_stream", {"inputs": "y"}, Family.TGI, True, "inputs"),
    ("/", {"inputs": "y", "stream": True}, Family.TGI, True, "inputs"),
    ("/v1/chat/completions", {"messages": []}, Family.OPENAI, False, "messages"),
    ("/v2/models/m/generate_stream", {"text_input": "x", "stream": False}, Family.TRITON, True,
     "text_input"),
    ("/v2/models/m/infer", {"inputs": []}, Family.TRITON, False, "inputs"),
])
def test_resolve(path, body, family, stream, prompt) -> None:
    route = routes.inference_route("POST", path)
    assert route is not None
    assert route.resolve(body) == routes.Resolved(family, stream, prompt)


def test_generate_without_prompt_or_inputs_is_refused() -> None:
    with pytest.raises(ValueError):
        routes.BY_NAME["generate"].resolve({"stream": True})
    assert routes.inference_route("GET", "/generate") is None
    assert routes.BY_NAME["triton.generate_stream"].stream is Stream.ALWAYS
