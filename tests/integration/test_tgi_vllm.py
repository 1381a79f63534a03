"""TGI (spec §3) and vLLM ``/generate`` (spec §4.1) over a real socket with the real model.

The TGI side is driven by ``huggingface_hub.InferenceClient`` (synchronous: run in a
thread so the session loop keeps serving) and by httpx; the vLLM side by httpx.
"""

from __future__ import annotations

import asyncio

import pytest
from huggingface_hub import InferenceClient

from tests.sse import read_sse

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def client(server_client):
    """Every test here runs against a mixed server and against PD (conftest ``server``)."""
    return server_client

CJK_EMOJI = "你好，世界！🌍🚀 我爱北京。😀\n" * 3


def chat(server, user: str) -> str:
    """A one-turn ChatML prompt as text, ready for the assistant's answer."""
    return server.engine.tokenizer.apply_chat_template([{"role": "user", "content": user}],
                                                     add_generation_prompt=True)


async def tgi_events(client, path: str, body: dict) -> list[dict]:
    """All SSE events of a TGI stream; each event must be valid UTF-8 on its own."""
    return await read_sse(client, path, body)


async def vllm_chunks(client, body: dict) -> list[dict]:
    """All NUL-delimited JSON chunks of a vLLM stream (spec §4.1)."""
    return await read_sse(client, "/generate", {**body, "stream": True}, prefix=b"", sep=b"\0")


async def vllm(client, body: dict) -> list[str]:
    r = await client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["text"]


# --------------------------------------------------------------------------- TGI


async def test_tgi_client_details(server):
    hf = InferenceClient(base_url=server.url)
    out = await asyncio.to_thread(hf.text_generation, chat(server, "What is the capital of France?"),
                                  details=True, max_new_tokens=16, top_n_tokens=3)
    assert "Paris" in out.generated_text, out
    d = out.details
    assert d.finish_reason in ("eos_token", "length")
    assert d.generated_tokens == len(d.tokens) and d.generated_tokens <= 16
    assert isinstance(d.seed, int) and d.prefill == []
    await server.assert_idle_and_leak_free()


async def test_tgi_client_stream_equals_non_stream(server):
    hf = InferenceClient(base_url=server.url)
    prompt = chat(server, "Explain what a cat is in two sentences.")
    full = await asyncio.to_thread(hf.text_generation, prompt, max_new_tokens=20)
    tokens = await asyncio.to_thread(
        lambda: list(hf.text_generation(prompt, max_new_tokens=20, stream=True)))
    assert "".join(tokens) == full
    events = await asyncio.to_thread(
        lambda: list(hf.text_generation(prompt, max_new_tokens=20, stream=True, details=True)))
    last = events[-1]
    assert last.generated_text == full
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    assert sum(len(e.token.id) for e in events) == last.details.generated_tokens
    assert last.details.finish_reason in ("eos_token", "length")


async def test_tgi_full_text_and_prefill(server, client):
    prompt = "The quick brown fox"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 4, "return_full_text": True,
                                             "decoder_input_details": True}}
    r = await client.post("/generate", json=body)
    obj = r.json()
    d = obj["details"]
    assert obj["generated_text"].startswith(prompt + " ")
    assert len(d["prefill"]) == d["prompt_tokens"] == len(server.engine.tokenizer.encode(prompt))
    assert [t["id"] for t in d["prefill"]] == server.engine.tokenizer.encode(prompt)


async def test_tgi_cjk_emoji_stream_has_no_replacement_char(server, client):
    body = {"inputs": CJK_EMOJI, "parameters": {"max_new_tokens": 24}}
    events = await tgi_events(client, "/generate_stream", body)
    pieces = [e["token"]["text"] for e in events]
    final = events[-1]["generated_text"]
    assert all("\ufffd" not in p for p in pieces) and "\ufffd" not in final
    assert any(ord(c) > 0xFFFF for c in final), final
    assert any("\u4e00" <= c <= "\u9fff" for c in final), final
    assert "".join(pieces) == final
    r = await client.post("/generate", json=body)
    assert r.json()["generated_text"] == final


# --------------------------------------------------------------------------- vLLM


async def test_vllm_stream_equals_non_stream(server, client):
    prompt = chat(server, "Give me one fact about the moon.")
    [text] = await vllm(client, {"prompt": prompt, "max_tokens": 20})
    assert text.startswith(prompt + " ")
    chunks = await vllm_chunks(client, {"prompt": prompt, "max_tokens": 20})
    assert all(len(c["text"]) == 1 for c in chunks)
    assert prompt + " " + "".join(c["text"][0] for c in chunks) == text
    await server.assert_idle_and_leak_free()


async def test_vllm_cjk_emoji_stream_has_no_replacement_char(server, client):
    chunks = await vllm_chunks(client, {"prompt": CJK_EMOJI, "max_tokens": 24})
    pieces = [c["text"][0] for c in chunks]
    streamed = "".join(pieces)
    assert all("\ufffd" not in p for p in pieces)
    assert any(ord(c) > 0xFFFF for c in streamed) and any("\u4e00" <= c <= "\u9fff" for c in streamed)
    [text] = await vllm(client, {"prompt": CJK_EMOJI, "max_tokens": 24})
    assert text == CJK_EMOJI + " " + streamed


async def test_vllm_n_sampled_sequences(server, client):
    prompt = chat(server, "Name a colour.")  # PD: split by the coordinator (issue 40)
    texts = await vllm(client, {"prompt": prompt, "max_tokens": 8, "n": 2, "temperature": 0.9,
                                "seed": 7})
    assert len(texts) == 2 and all(t.startswith(prompt + " ") for t in texts)
    assert texts == await vllm(client, {"prompt": prompt, "max_tokens": 8, "n": 2,
                                        "temperature": 0.9, "seed": 7})  # seeded
    await server.assert_idle_and_leak_free()


# --------------------------------------------------------------------------- stop strings
# These depend on the engine's stop-string support (SamplingParams.stop).


async def test_tgi_stop_string_cuts_before_period(server, client):
    prompt = chat(server, "What is the capital of France?")
    base = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True}}
    full = (await client.post("/generate", json=base)).json()["generated_text"]
    assert "." in full, full
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 24, "details": True, "stop": ["."]}}
    out = (await client.post("/generate", json=body)).json()
    assert out["generated_text"] == full[: full.index(".")]
    assert out["details"]["finish_reason"] == "eos_token"
    events = await tgi_events(client, "/generate_stream", body)
    assert events[-1]["generated_text"] == out["generated_text"]
    assert "".join(e["token"]["text"] for e in events) == out["generated_text"]
    await server.assert_idle_and_leak_free()


async def test_vllm_stop_string(server, client):
    prompt = chat(server, "What is the capital of France?")
    [full] = await vllm(client, {"prompt": prompt, "max_tokens": 24})
    gen = full[len(prompt) + 1:]
    assert "." in gen, gen
    cut = gen[: gen.index(".")]
    assert await vllm(client, {"prompt": prompt, "max_tokens": 24, "stop": "."}) == [f"{prompt} {cut}"]
    kept = await vllm(client, {"prompt": prompt, "max_tokens": 24, "stop": ["."],
                               "include_stop_str_in_output": True})
    assert kept == [f"{prompt} {cut}."]
    chunks = await vllm_chunks(client, {"prompt": prompt, "max_tokens": 24, "stop": ["."]})
    assert "".join(c["text"][0] for c in chunks) == cut
    await server.assert_idle_and_leak_free()


# --------------------------------------------------------------------------- disconnect


@pytest.mark.parametrize("family", ["tgi", "vllm"])
async def test_client_disconnect_mid_stream_frees_kv_blocks(server, family):
    # max_new_tokens 200: the request must still be running when the client leaves
    # (it is aborted after three chunks, so this stays fast)
    prompt = chat(server, "Write a very long essay about the history of Rome.")
    if family == "tgi":
        path, body, sep = "/generate_stream", {"inputs": prompt,
                                               "parameters": {"max_new_tokens": 200}}, b"\n\n"
    else:
        path, body, sep = "/generate", {"prompt": prompt, "max_tokens": 200, "stream": True}, b"\0"
    await server.assert_idle_and_leak_free()
    await server.disconnect_mid_stream(path, body, sep)


# --------------------------------------------------------------------------- /info


async def test_info(server, client):
    obj = (await client.get("/info")).json()
    [model] = obj["models"]
    assert model["model_id"] == server.engine.model_name
    assert model["max_total_tokens"] == server.engine.max_model_len
    assert model["model_dtype"] == "float32" and model["model_device_type"] == "cpu"
    assert obj["max_concurrent_requests"] == 32 and obj["max_batch_total_tokens"] == 2048
    assert obj["max_input_length"] == server.engine.max_model_len - 1
    # both are MindIE's maxBatchSize: one number (PD: the cluster's, its decode
    # instances' sum, issue 40; the pair has one D of 32)
    slots = (await client.get(f"/v2/models/{model['model_id']}/getSlotCount")).json()
    assert obj["max_concurrent_requests"] == slots["total_slots"]
