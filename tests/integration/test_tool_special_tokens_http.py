"""Tool-call markers that are special tokens (issue 39), end to end over HTTP.

Real tokenizers hold the markers as added tokens with ``special: true`` (Qwen2.5's
``<tool_call>`` / ``</tool_call>``, Mistral's ``[TOOL_CALLS]``, Granite's
``<|tool_call|>``, Llama 3.1's ``<|python_tag|>``). Here a tiny random Llama-layout model
(tests/families.py) gets SmolLM2's tokenizer plus those five markers as special tokens
(one id each; the model's vocabulary grows to hold them). ``tool_choice: required``
makes the grammar write the marker as its special token (the logprobs show it as one
token), and the answer is still parsed into ``tool_calls``, stream and non-stream, with
no marker left in ``content``: the detokeniser keeps exactly the format's marker tokens
for a request with tools. Without tools, the same special token is skipped as before.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import torch
import transformers as T
from tokenizers import AddedToken, Tokenizer

from tests.families import COMMON, VOCAB, randomize
from tests.integration.test_families_http import _served
from tests.integration.test_tool_formats_http import SCHEMAS, TEMPLATES, TOOLS
from tokenserve.models.loader import resolve_model

pytestmark = pytest.mark.asyncio(loop_scope="session")

MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|tool_call|>", "<|python_tag|>"]
IDS = {m: VOCAB + i for i, m in enumerate(MARKERS)}  # appended after SmolLM2's 49152 ids


def build_with_markers(d, template: str | None) -> None:
    """A tiny Llama whose tokenizer holds :data:`MARKERS` as special tokens; ``template``
    replaces SmolLM2's chat template (None keeps it: Hermes, our default prompt)."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(
        T.LlamaConfig(**{**COMMON, "vocab_size": VOCAB + len(MARKERS)})).eval().float()
    randomize(model, 0)
    model.save_pretrained(d)
    src = resolve_model(None)
    tk = Tokenizer.from_file(str(src / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    assert {m: tk.token_to_id(m) for m in MARKERS} == IDS
    (d / "tokenizer.json").write_text(tk.to_str())
    shutil.copy(src / "tokenizer_config.json", d / "tokenizer_config.json")
    if template is not None:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))


async def _stream(client, body: dict) -> tuple[str, dict[int, list[str]], list[str]]:
    """A streamed chat answer: (content, {index: [name, arguments]}, finish reasons)."""
    content, calls, reasons = "", {}, []
    async with client.stream("POST", "/v1/chat/completions",
                             json={**body, "stream": True}) as s:
        assert s.status_code == 200
        async for line in s.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])["choices"][0]
            content += ch["delta"].get("content") or ""
            for it in ch["delta"].get("tool_calls") or []:
                got = calls.setdefault(it["index"], [it["function"].get("name"), ""])
                got[1] += it["function"]["arguments"]
            if ch["finish_reason"]:
                reasons.append(ch["finish_reason"])
    return content, calls, reasons


@pytest.mark.parametrize("family,marker", [("hermes", "<tool_call>"),
                                           ("mistral", "[TOOL_CALLS]"),
                                           ("granite", "<|tool_call|>")])
async def test_special_marker_call_is_parsed(family, marker, tmp_path) -> None:
    build_with_markers(tmp_path, None if family == "hermes" else TEMPLATES[family])
    body = {"model": "x", "messages": [{"role": "user", "content": "Switch it on."}],
            "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0,
            "parallel_tool_calls": False, "logprobs": True}
    async with _served(tmp_path, "float32") as (engine, client):
        body["model"] = engine.model_name
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tokens = [e["token"] for e in choice["logprobs"]["content"]]
        assert tokens[0] == marker, tokens  # the grammar wrote the special token itself
        if family == "hermes":
            assert "</tool_call>" in tokens
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None  # no marker leaks into content
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1
        name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
        jsonschema.validate(args, SCHEMAS[name])

        content, streamed, reasons = await _stream(client, body)
        assert content == ""
        assert [streamed[i] for i in sorted(streamed)] == \
            [[c["function"]["name"], c["function"]["arguments"]] for c in calls]
        assert reasons == ["tool_calls"]


async def test_without_tools_special_tokens_stay_skipped(tmp_path) -> None:
    """A chat without tools whose grammar forces the ``<tool_call>`` special token: the
    token is generated (logprobs) but, as before, not in the text."""
    build_with_markers(tmp_path, None)
    grammar = f'start: <[{IDS["<tool_call>"]}]> "yes"'
    body = {"model": "x", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 10,
            "temperature": 0, "logprobs": True, "guided_grammar": grammar}
    async with _served(tmp_path, "float32") as (engine, client):
        body["model"] = engine.model_name
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["content"][0]["token"] == "<tool_call>"
        assert choice["message"]["content"] == "yes"
        assert choice["message"]["tool_calls"] == []
        content, calls, _ = await _stream(client, body)
        assert content == "yes" and calls == {}
