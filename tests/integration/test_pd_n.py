"""``n = 2`` through the PD coordinator (issue 40): real sockets, a coordinator with 1 P +
1 D (conftest ``pd_pair``) against the in-process mixed server (``live``), the same model
and settings. The coordinator splits the request into single-sequence ones and merges
their answers (tokenserve/coordinator/fanout.py): what the client gets has the mixed
server's shape, and the same tokens where the sampling is pinned (``top_k`` 1, or the
same seed: choice ``i`` samples with ``seed + i`` on both)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest
import pytest_asyncio

from tokenserve.api.routes import path_of

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "The three primary colours are"
#: sampled, but only the most likely token survives: every choice is the greedy answer
PINNED = {"n": 2, "temperature": 1.0, "extra_body": {"top_k": 1}}


@pytest_asyncio.fixture(loop_scope="session")
async def sdks(live, pd_pair):
    """(mixed, pd) openai clients."""
    mixed = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0,
                               timeout=300)
    pd = openai.AsyncOpenAI(base_url=pd_pair.coord.url + "/v1", api_key="x", max_retries=0,
                            timeout=300)
    yield mixed, pd
    await mixed.close()
    await pd.close()


async def leak_free(live, pd_pair) -> None:
    """Nothing running and every KV block free, on P and D (and the mixed server)."""
    await asyncio.to_thread(pd_pair.assert_leak_free)
    await live.assert_idle_and_leak_free()


async def test_completions_n2_non_stream_and_stream(live, pd_pair, sdks):
    mixed, pd = sdks
    model = live.engine.model_name
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 10}
    greedy = await mixed.completions.create(temperature=0, **kw)
    g = greedy.choices[0].text
    assert g

    out = await pd.completions.create(seed=5, **PINNED, **kw)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [g, g]
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    # usage: the prompt counted once (as OpenAI), completions summed
    assert out.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert out.usage.completion_tokens == 2 * greedy.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    same = await mixed.completions.create(seed=5, **PINNED, **kw)
    assert [c.text for c in same.choices] == [g, g]

    chunks = [c async for c in await pd.completions.create(stream=True, seed=5, **PINNED,
                                                           **kw)]
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == {0: g, 1: g}
    assert len({c.id for c in chunks}) == 1
    finished = sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason)
    assert finished == [0, 1]
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]]  # on the last finishing chunk only, summed
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
        out.usage.prompt_tokens, out.usage.completion_tokens)
    await leak_free(live, pd_pair)


async def test_completions_n2_seeded_sampling_matches_the_mixed_server(live, pd_pair, sdks):
    """Choice ``i`` samples with ``seed + i`` on both servers (fp32, batch invariant):
    the same texts, choice by choice; and they differ from each other."""
    mixed, pd = sdks
    kw = {"model": live.engine.model_name, "prompt": PROMPT, "max_tokens": 10, "n": 2,
          "temperature": 1.0, "seed": 123}
    a = await mixed.completions.create(**kw)
    b = await pd.completions.create(**kw)
    assert [c.text for c in b.choices] == [c.text for c in a.choices]
    assert b.choices[0].text != b.choices[1].text
    await leak_free(live, pd_pair)


async def test_chat_n2_non_stream_and_stream(live, pd_pair, sdks):
    mixed, pd = sdks
    kw = {"model": live.engine.model_name, "max_tokens": 10,
          "messages": [{"role": "user", "content": "Name a fruit."}]}
    greedy = await mixed.chat.completions.create(temperature=0, **kw)
    g = greedy.choices[0].message.content
    out = await pd.chat.completions.create(seed=9, **PINNED, **kw)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.message.content for c in out.choices] == [g, g]
    assert all(c.message.role == "assistant" for c in out.choices)
    assert out.usage.prompt_tokens == greedy.usage.prompt_tokens
    assert out.usage.completion_tokens == 2 * greedy.usage.completion_tokens

    chunks = [c async for c in await pd.chat.completions.create(stream=True, seed=9,
                                                                **PINNED, **kw)]
    texts = {0: "", 1: ""}
    roles = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add(ch.index)
    assert texts == {0: g, 1: g} and roles == {0, 1}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert sorted(ch.index for c in chunks for ch in c.choices if ch.finish_reason) == [0, 1]
    await leak_free(live, pd_pair)


async def test_stream_has_one_done_and_one_usage_chunk(live, pd_pair):
    """The raw stream: one ``data: [DONE]`` at the very end, ``include_usage``'s one
    usage chunk just before it (choices empty, summed)."""
    body = {"model": live.engine.model_name, "prompt": PROMPT, "max_tokens": 6, "n": 2,
            "temperature": 1.0, "top_k": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=pd_pair.coord.url, timeout=300) as c:
        r = await c.post(path_of("openai.completions"), json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events.count(b"data: [DONE]") == 1 and events[-1] == b"data: [DONE]"
    objs = [orjson.loads(e[len(b"data: "):]) for e in events[:-1]]
    usage = [o for o in objs if o.get("usage") is not None]
    assert usage == [objs[-1]] and objs[-1]["choices"] == []
    assert objs[-1]["usage"]["completion_tokens"] == 12
    assert {ch["index"] for o in objs for ch in o["choices"]} == {0, 1}
    await leak_free(live, pd_pair)


async def test_vllm_generate_n2(live, pd_pair):
    tok = live.engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                     add_generation_prompt=True)
    path = path_of("generate")
    base = {"prompt": prompt, "max_tokens": 8}
    async with httpx.AsyncClient(base_url=live.url, timeout=300) as m, \
            httpx.AsyncClient(base_url=pd_pair.coord.url, timeout=300) as pd:
        greedy = (await m.post(path, json=base)).json()["text"][0]
        pinned = {**base, "n": 2, "temperature": 1.0, "top_k": 1, "seed": 3}
        r = await pd.post(path, json=pinned)
        assert r.status_code == 200, r.text
        assert r.json() == {"text": [greedy, greedy]}

        seeded = {**base, "n": 2, "temperature": 0.9, "seed": 7}
        want = (await m.post(path, json=seeded)).json()["text"]
        got = (await pd.post(path, json=seeded)).json()["text"]
        assert len(got) == 2 and all(t.startswith(prompt + " ") for t in got)
        # [I] seed order through the coordinator; the mixed server ranks by logprob
        assert sorted(got) == sorted(want)

        async with pd.stream("POST", path, json={**seeded, "stream": True}) as s:
            assert s.status_code == 200
            raw = b"".join([part async for part in s.aiter_bytes()])
    chunks = [orjson.loads(c) for c in raw.split(b"\0") if c]
    assert chunks and all(len(c["text"]) == 2 for c in chunks)
    streamed = [prompt + " " + "".join(c["text"][i] for c in chunks) for i in (0, 1)]
    assert streamed == got
    await leak_free(live, pd_pair)


async def test_requests_the_mixed_server_refuses_get_its_answer(live, pd_pair, sdks):
    """Not split (the coordinator does not validate): P answers as the mixed server."""
    mixed, pd = sdks
    kw = {"model": live.engine.model_name, "prompt": PROMPT, "max_tokens": 4, "n": 2,
          "temperature": 0}
    errors = []
    for client in (mixed, pd):
        with pytest.raises(openai.UnprocessableEntityError) as exc:
            await client.completions.create(**kw)
        errors.append(exc.value.body)
    assert errors[0] == errors[1]
    await leak_free(live, pd_pair)


async def _counters(url: str) -> dict[str, float]:
    """MindIE's request counters of one /metrics, summed over their series."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.get("/metrics")
    assert r.status_code == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            if s.name in ("request_received_total", "request_success_total",
                          "request_failed_total", "time_to_first_token_seconds_count",
                          "e2e_request_latency_seconds_count"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def test_an_n2_request_is_counted_once_on_both(live, pd_pair, sdks):
    """The mixed server counts an n = 2 request (whole and streamed) once, as the
    coordinator does (issue 40): a dashboard reads the same numbers from either."""
    kw = {"model": live.engine.model_name, "prompt": PROMPT, "max_tokens": 4, "seed": 3,
          **PINNED}
    for client, url in zip(sdks, (live.url, pd_pair.coord.url), strict=True):
        before = await _counters(url)
        await client.completions.create(**kw)
        async for _ in await client.completions.create(stream=True, **kw):
            pass
        await leak_free(live, pd_pair)
        after = await _counters(url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        assert delta == {"request_received_total": 2, "request_success_total": 2,
                         "request_failed_total": 0, "time_to_first_token_seconds_count": 2,
                         "e2e_request_latency_seconds_count": 2}, (url, delta)
