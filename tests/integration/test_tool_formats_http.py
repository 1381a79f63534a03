"""Each non-Hermes tool-call format end to end (issue 39): a tiny random Llama-layout
model (tests/families.py) whose tokenizer_config.json carries a chat template in the
family's style, served in-process; ``tool_choice: required`` is answered with a call of a
listed tool whose arguments validate, because the grammar is the template's format and
the reader parses that same format (stream and non-stream agree)."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from tests.families import build
from tests.integration.test_families_http import _served

pytestmark = pytest.mark.asyncio(loop_scope="session")

# bounded arguments (enums, booleans, closed objects): a random model cannot run past max_tokens
TOOLS = [
    {"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
        "required": ["unit", "ok"]}}},
    {"type": "function", "function": {"name": "toggle", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
_TURNS = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
          "{%- if m.tool_calls %}CALLS{{ m.tool_calls|tojson }}{% endif %}<|im_end|>\n"
          "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {  # the marker each family's real template writes calls with
    "mistral": "{%- if tools %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
               + _TURNS.replace("CALLS", "[TOOL_CALLS] "),
    "granite": "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>"
               "{{ tools|tojson }}{% endif %}" + _TURNS.replace("CALLS", "<|tool_call|>"),
    "llama": '{%- if tools %}Answer with {"name": function name, "parameters": dictionary}.'
             "{{ tools|tojson }}{% endif %}" + _TURNS.replace("CALLS", "<|python_tag|>"),
}


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build("llama", d)
    return d


@pytest.mark.parametrize("family", list(TEMPLATES))
async def test_required_call_in_the_family_format(family, base_model, tmp_path) -> None:
    d = tmp_path / family
    shutil.copytree(base_model, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATES[family]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    body = {"model": "x", "messages": [{"role": "user", "content": "Switch it on."}],
            "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0,
            "parallel_tool_calls": False}  # a random model would call until max_tokens
    async with _served(d, "float32") as (engine, client):
        body["model"] = engine.model_name
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls
        for c in calls:
            name, args = c["function"]["name"], json.loads(c["function"]["arguments"])
            jsonschema.validate(args, SCHEMAS[name])
        streamed: dict[int, list[str]] = {}
        async with client.stream("POST", "/v1/chat/completions",
                                 json={**body, "stream": True}) as s:
            async for line in s.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                for it in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                    fn = it["function"]
                    got = streamed.setdefault(it["index"], [fn.get("name"), ""])
                    got[1] += fn["arguments"]
        assert [streamed[i] for i in sorted(streamed)] == \
            [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
