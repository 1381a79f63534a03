"""The OpenAI family (spec/interfaces.md §5) with the real model, through the real
``openai`` SDK."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
import pytest_asyncio

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def client(server_client):
    """Every test here runs against a mixed server and against PD (conftest ``server``)."""
    return server_client

EMOJI_LINE = "你好，世界！🌍🚀 我爱北京。😀\n"


@pytest_asyncio.fixture(loop_scope="session")
async def sdk(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                timeout=120)
    yield client
    await client.close()


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def chat(sdk, server, text: str, **kw):
    return await sdk.chat.completions.create(model=server.engine.model_name,
                                             messages=user(text), **kw)


async def cmpl(sdk, server, prompt, **kw):
    return await sdk.completions.create(model=server.engine.model_name, prompt=prompt, **kw)


async def test_models(sdk, server):
    models = [m.id async for m in sdk.models.list()]
    assert models == [server.engine.model_name]
    model = await sdk.models.retrieve(server.engine.model_name)
    assert model.owned_by == "MindIE Server"
    with pytest.raises(openai.NotFoundError) as exc:
        await sdk.models.retrieve("no-such-model")
    assert "Model no-such-model not found." in exc.value.message


async def test_chat_answers_and_counts_usage(sdk, server):
    q = "What is the capital of France?"
    out = await chat(sdk, server, q, max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert out.id.startswith("chatcmpl-") and out.model == server.engine.model_name
    assert out.usage.prompt_tokens == len(server.chat_ids(q))
    ids = server.engine.tokenizer.encode(choice.message.content, add_special_tokens=False)
    assert out.usage.completion_tokens in (len(ids), len(ids) + 1)  # + the EOS token
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    await server.assert_idle_and_leak_free()


async def test_completion_length_and_usage(sdk, server):
    prompt = "The quick brown fox"
    out = await cmpl(sdk, server, prompt, max_tokens=5, temperature=0,
                     extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.id.startswith("cmpl-")
    assert out.usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 5


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_greedy_stream_equals_non_stream(sdk, server, kind):
    kw = {"max_tokens": 16, "temperature": 0}
    if kind == "chat":
        q = "Explain what a cat is in two sentences."
        full = (await chat(sdk, server, q, **kw)).choices[0].message.content
        chunks = [c async for c in await chat(sdk, server, q, stream=True, **kw)]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].choices[0].delta.content == ""
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        prompt = "Once upon a time, in a small village,"
        full = (await cmpl(sdk, server, prompt, **kw)).choices[0].text
        chunks = [c async for c in await cmpl(sdk, server, prompt, stream=True, **kw)]
        text = "".join(c.choices[0].text for c in chunks)
    assert text == full and full
    assert len({c.id for c in chunks}) == 1  # one id per response (PD: P's and D's chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage is not None  # usage rides on the finishing chunk
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    await server.assert_idle_and_leak_free()


async def test_stream_include_usage(sdk, server):
    q = "Name three colours."
    kw = {"max_tokens": 8, "temperature": 0}
    plain = (await chat(sdk, server, q, **kw)).usage
    chunks = [c async for c in await chat(sdk, server, q, stream=True,
                                          stream_options={"include_usage": True}, **kw)]
    got = chunks[-1].usage
    assert chunks[-1].choices == [] and got is not None
    # the repeated prompt may now be served from the prefix cache: compare the counts
    assert (got.prompt_tokens, got.completion_tokens, got.total_tokens) == (
        plain.prompt_tokens, plain.completion_tokens, plain.total_tokens)
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


async def test_stream_sends_special_tokens_when_asked(sdk, server):
    """With ``skip_special_tokens: false`` every generated token sends its chunk, special
    ones included (what ``tokenserve bench --backend openai`` sends, so that its TTFT and ITL
    time each token); by default their text, and so their chunks, are skipped."""
    prompt = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n"
    got = {}
    for skip in (True, False):
        chunks = [c async for c in await cmpl(
            sdk, server, prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "skip_special_tokens": skip})]
        assert chunks[-1].usage.completion_tokens == 12
        got[skip] = [c.choices[0].text for c in chunks if c.choices]
    assert len(got[False]) == 12 and all(got[False])
    assert any(t.startswith("<|im_") for t in got[False])
    assert len(got[True]) < 12 and not any("<|im_" in t for t in got[True])
    assert "".join(got[True]) == "".join(t for t in got[False] if not t.startswith("<|im_"))
    await server.assert_idle_and_leak_free()


async def test_n2_chat_and_completions(sdk, server):
    # PD: the coordinator splits the request into one-sequence ones (issue 40)
    out = await chat(sdk, server, "Write a word.", n=2, max_tokens=8, temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == sum(
        len(server.engine.tokenizer.encode(c.message.content, add_special_tokens=False))
        + (c.finish_reason == "stop") for c in out.choices)
    chunks = [c async for c in await cmpl(sdk, server, ["Hello", "Bye"], n=2, max_tokens=6,
                                          stream=True, seed=1)]
    finished = sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason)
    assert finished == [0, 1, 2, 3]
    await server.assert_idle_and_leak_free()


async def test_seed_reproducible_with_sampling(sdk, server):
    kw = {"n": 2, "max_tokens": 12, "temperature": 1.2, "top_p": 0.95, "seed": 1234}
    a = await chat(sdk, server, "Write a short poem about rain.", **kw)
    b = await chat(sdk, server, "Write a short poem about rain.", **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content  # seed, seed+1


async def test_stop_string(sdk, server):
    prompt = "1, 2, 3, 4, 5,"
    full = (await cmpl(sdk, server, prompt, max_tokens=16, temperature=0)).choices[0].text
    assert " 8," in full, full  # the model counts on
    out = await cmpl(sdk, server, prompt, max_tokens=16, temperature=0, stop=[" 8"])
    assert out.choices[0].text == full[: full.index(" 8")]
    assert out.choices[0].finish_reason == "stop"
    chunks = [c async for c in await cmpl(sdk, server, prompt, max_tokens=16, temperature=0,
                                          stop=" 8", stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text
    await server.assert_idle_and_leak_free()


async def test_chinese_and_emoji_stream_without_replacement_chars(sdk, server):
    prompt = EMOJI_LINE * 3
    kw = {"max_tokens": 18, "temperature": 0}  # 18 tokens = "你好，世界！🌍🚀" if it repeats
    full = (await cmpl(sdk, server, prompt, **kw)).choices[0].text
    pieces = [c.choices[0].text async for c in await cmpl(sdk, server, prompt, stream=True, **kw)]
    assert "".join(pieces) == full
    # only a character cut by max_tokens may end the text as U+FFFD (the final flush)
    assert "\ufffd" not in "".join(pieces[:-1]) + full.rstrip("\ufffd"), pieces
    assert any(ord(ch) > 0xFFFF for ch in full) and "你好" in full, full  # emoji + CJK


async def test_logprobs(sdk, server):
    out = await chat(sdk, server, "Say hello.", max_tokens=6, temperature=0, logprobs=True,
                     top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-4)  # greedy
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", errors="replace").startswith(out.choices[0].message.content[:3])
    c = await cmpl(sdk, server, "The sky is", max_tokens=5, temperature=0, logprobs=2,
                   extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


async def test_validation_errors_are_422(sdk, server):
    # the SDK shows the message (OpenAI error shape), not just "Error code: 422"
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await chat(sdk, server, "hi", max_tokens=4, top_p=0)
    assert exc.value.status_code == 422
    assert "Parameter top_p must be in (0.0,1.0], got 0" in str(exc.value)
    assert "Parameter top_p must be in (0.0,1.0], got 0" in exc.value.message
    assert exc.value.type == "Input Validation Error"
    assert exc.value.body["message"].startswith("Parameter top_p")
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await cmpl(sdk, server, "hi", max_tokens=4, temperature=-1)
    assert "Parameter temperature must be in" in str(exc.value)
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await chat(sdk, server, "hi", max_tokens=4, n=2, temperature=0)
    assert "must be 1 when temperature is 0" in exc.value.message
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        await sdk.chat.completions.create(model="nope", messages=user("hi"), max_tokens=4)
    assert "Model not found" in exc.value.message
    out = await chat(sdk, server, "hi", max_tokens=2, extra_body={"repetition_penalty": 1.1,
                                                                 "top_k": -1}, user="me")
    assert out.choices[0].finish_reason in ("stop", "length")


async def test_disconnect_mid_stream_frees_blocks(sdk, server):
    await server.assert_idle_and_leak_free()
    before = await server.aborted()
    n = 1 if server.kind == "pd" else 2  # PD: one sequence per request
    stream = await chat(sdk, server, "Tell me a long story about a dragon.", n=n, max_tokens=200,
                        stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 4:
            break
    await stream.close()
    await asyncio.sleep(0.05)
    await server.assert_idle_and_leak_free()
    assert await server.aborted_at_least(before + n) >= before + n
