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


# ------------------------------------------------------------------ family descriptions

#: the one module that may compare a family's name with a literal (issue 40)
DESCRIPTION_MODULE = PACKAGE / "api" / "families.py"
#: Not this server's families: the benchmark is a client of other servers too; its
#: ``--backend`` names are its own table's (loadgen/clients.py ``BACKEND_TABLE``: nine, with
#: ``openai-chat``, ``mindie-text``, ``llamacpp``), of which five are spelled as families.
OUT_OF_SCOPE = (PACKAGE / "loadgen",)
#: (file, literal) comparisons left for now, each with why. Only in files another engineer
#: is reworking (the PD hand-off in api/<family>/handlers.py); remove an entry with its
#: comparison.
ALLOWED_FAMILY_COMPARISONS = {
    # MindIE's ``ServerConfig.openAiSupport`` value ("vllm" is its default), a setting
    # spelled like the family, not a family: `openai_support != "vllm"`
    ("tokenserve/api/openai/handlers.py", "vllm"),
}


def _family_literal_comparisons(path: pathlib.Path, names: frozenset[str]) -> set[str]:
    """The family names ``path`` compares with a string literal: either side of ``==``,
    ``!=``, ``is``, ``in`` (a tuple, list or set of literals too), or a ``case`` pattern."""

    def literals(node: ast.AST) -> set[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            return {n.value for n in node.elts
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        return set()

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                found |= literals(side) & names
        elif isinstance(node, ast.MatchValue):
            found |= literals(node.value) & names
    return found


def test_only_the_description_module_compares_family_names() -> None:
    """Issue 40: a family's knowledge (prompt fields, framing, error shape, several
    sequences) is read from its description (api/families.py), never re-derived by
    comparing its name with a literal."""
    from tokenserve.api.families import FAMILIES

    names = frozenset(f.value for f in FAMILIES)
    offenders, allowed_seen = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == DESCRIPTION_MODULE or any(d in path.parents for d in OUT_OF_SCOPE):
            continue
        rel = str(path.relative_to(ROOT))
        for name in sorted(_family_literal_comparisons(path, names)):
            if (rel, name) in ALLOWED_FAMILY_COMPARISONS:
                allowed_seen.add((rel, name))
            else:
                offenders.append(f"{rel}: compares a family name with {name!r}")
    assert not offenders, "\n".join(offenders)
    stale = ALLOWED_FAMILY_COMPARISONS - allowed_seen
    assert not stale, f"allow-list entries with no comparison left: {sorted(stale)}"


def test_the_family_check_sees_every_spelling(tmp_path: pathlib.Path) -> None:
    """The negative control: each way of comparing a name with a literal is caught."""
    names = frozenset({"vllm", "openai", "triton"})
    src = tmp_path / "m.py"
    src.write_text("def f(family, x):\n"
                   "    a = family == 'vllm'\n"
                   "    b = 'openai' != x.family\n"
                   "    c = family in ('triton', 'other')\n"
                   "    match family:\n"
                   "        case 'vllm' | 'x':\n"
                   "            pass\n"
                   "    return family.replace('openai', '')  # not a comparison\n")
    assert _family_literal_comparisons(src, names) == {"vllm", "openai", "triton"}
    src.write_text("d = {'vllm': 1}\nf('openai')\n")
    assert _family_literal_comparisons(src, names) == set()
