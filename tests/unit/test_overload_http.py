"""A full engine queue is refused at once with 503 in each family's error shape.

Streaming routes included: the engine request is admitted before the head is sent, so a
refusal is an ordinary error answer, never a 200 head followed by a broken stream. A
fan-out (``n`` > 1) admits every request first; when one is refused, the ones already
admitted are aborted.
"""

from __future__ import annotations

import httpx
import pytest

from tests.fakes import FakeEngine, FakeTokenizer, wait_for
from tokenserve.messages import EngineOverloadedError
from tokenserve.server.app import build_router
from tokenserve.transport.server import HttpServer

MESSAGE = "too many requests"


class ChatTokenizer(FakeTokenizer):
    """The fake tokenizer plus a toy chat template (for ``/v1/chat/completions``)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"


class FullEngine(FakeEngine):
    """Admits ``admit`` requests, then refuses every other one (queue full)."""

    admit: int = 0
    admitted: list[str]

    def generate(self, request):
        if len(self.admitted) >= self.admit:
            raise EngineOverloadedError(MESSAGE)
        self.admitted.append(request.request_id)
        return super().generate(request)


def full_engine(admit: int = 0) -> FullEngine:
    engine = FullEngine(delay=0.05, tokenizer=ChatTokenizer())
    engine.admit, engine.admitted = admit, []
    return engine


async def serve(engine: FakeEngine):
    server = HttpServer(build_router(engine))
    await server.start("127.0.0.1", 0)
    return server


@pytest.fixture
async def client():
    server = await serve(full_engine())
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}") as c:
        yield c
    await server.close(timeout=1.0)


def assert_mindie_503(r: httpx.Response) -> None:
    """MindIE's wrapper (native, TGI, vLLM, Triton)."""
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"error": MESSAGE, "error_type": "Service Unavailable"}


def assert_openai_503(r: httpx.Response) -> None:
    """OpenAI's shape plus MindIE's ``error_type``."""
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {
        "error": {"message": MESSAGE, "type": "Service Unavailable", "param": None,
                  "code": 503},
        "error_type": "Service Unavailable",
    }


SAMPLE = {"temperature": 1.0}
MINDIE_FAMILY = [
    # native
    ("/infer", {"inputs": "hi"}),
    ("/infer", {"inputs": "hi", "stream": True}),
    ("/infer_token", {"input_id": [1, 2]}),
    ("/infer_token", {"input_id": [1, 2], "stream": True}),
    # TGI
    ("/generate", {"inputs": "hi"}),
    ("/generate_stream", {"inputs": "hi"}),
    ("/", {"inputs": "hi"}),
    ("/", {"inputs": "hi", "stream": True}),
    # vLLM
    ("/generate", {"prompt": "hi"}),
    ("/generate", {"prompt": "hi", "stream": True}),
    ("/generate", {"prompt": "hi", "n": 2, **SAMPLE}),
    ("/generate", {"prompt": "hi", "n": 2, "stream": True, **SAMPLE}),
    # Triton
    ("/v2/models/fake-model/generate", {"text_input": "hi"}),
    ("/v2/models/fake-model/generate_stream", {"text_input": "hi"}),
]
OPENAI_FAMILY = [
    ("/v1/completions", {"model": "fake-model", "prompt": "hi"}),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "stream": True}),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "n": 2, **SAMPLE}),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "n": 2, "stream": True,
                         **SAMPLE}),
    ("/v1/completions", {"model": "fake-model", "prompt": ["hi", "yo"], "stream": True}),
    ("/v1/chat/completions", {"model": "fake-model",
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "fake-model", "stream": True,
                              "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "fake-model", "n": 2, "stream": True, **SAMPLE,
                              "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("path,body", MINDIE_FAMILY)
async def test_native_tgi_vllm_triton_answer_503(client, path, body):
    assert_mindie_503(await client.post(path, json=body))


@pytest.mark.parametrize("path,body", OPENAI_FAMILY)
async def test_openai_answers_503_in_its_shape(client, path, body):
    assert_openai_503(await client.post(path, json=body))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,body,check", [
    ("/generate", {"prompt": "hi", "n": 3, **SAMPLE}, assert_mindie_503),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "n": 3, **SAMPLE},
     assert_openai_503),
    ("/v1/chat/completions", {"model": "fake-model", "n": 3, **SAMPLE,
                              "messages": [{"role": "user", "content": "hi"}]},
     assert_openai_503),
])
async def test_fan_out_refused_in_part_aborts_the_admitted(path, body, check, stream):
    engine = full_engine(admit=2)  # 2 of the 3 choices get in, the third is refused
    server = await serve(engine)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.ports[0]}") as c:
            check(await c.post(path, json={**body, "stream": stream}))
            assert len(engine.admitted) == 2
            # no KV leak: both admitted requests were aborted, none ran to completion
            await wait_for(lambda: sorted(engine.aborted) == sorted(engine.admitted))
            assert engine.completed == []
            # the server is fine afterwards (the engine has room again)
            engine.admit = 4
            ok = await c.post(path, json={**body, "n": 2, "stream": stream, "max_tokens": 2})
            assert ok.status_code == 200, ok.text
    finally:
        await server.close(timeout=1.0)
