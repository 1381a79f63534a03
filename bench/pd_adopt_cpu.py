"""D's CPU time on the event loop per PD request before its first decode step (issue 40).

In one process, with the default model's tokenizer and chat template and no model: P's
real prefill path (``serve_prefill``, the family handler, ``PrefillObserver``) runs over a
stub engine that parks every request after one token, and the ``DecodeParameters`` P
would POST are captured; then D's real ``POST /v1/pd/decode`` route takes them, and the
stub engine notes ``time.thread_time()`` when D submits the adopted request (what the
engine's first decode step waits for, besides the KV pull on a worker thread). The
figure is that CPU time of the event-loop thread, from D receiving the hand-off to the
engine request's submission, one request at a time; median (and p10 / p90) over
``--requests`` streamed chat completions of varying prompts.

    PYTHONPATH=. python bench/pd_adopt_cpu.py [--requests 50] [--words 200]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenserve.aio import Signal
from tokenserve.config.tree import PdConfig
from tokenserve.engine.info import EngineInfo
from tokenserve.engine.output_stream import RequestHandle
from tokenserve.messages import FinishReason, GenerateRequest, KvHandoff, RequestOutput
from tokenserve.models.loader import resolve_model
from tokenserve.models.tokenizer import Tokenizer
from tokenserve.pd import prefill
from tokenserve.pd.node import PdNode
from tokenserve.pd.sinks import CaptureResponse
from tokenserve.server.app import build_router
from tokenserve.transport.cycle import HttpRequest

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "hex", "every", "jovial", "bard", "near", "twelve",
         "misty", "harbours"]


@dataclass
class StubEngine:
    """The EngineClient the handlers need, no model: a prefill-only request parks after
    one token; an adopted one notes when it was submitted, then ends."""

    tokenizer: Any
    info: EngineInfo
    submitted: list[float] = field(default_factory=list)

    def set_kv_puller(self, puller: Any) -> None:
        pass

    def release(self, request_id: str) -> bool:
        return True

    async def evict(self, request_id: str, timeout_s: float = 10.0) -> bool:
        return False

    def stats(self) -> None:
        return None

    def is_healthy(self) -> bool:
        return True

    async def compile_grammar(self, structured: Any) -> Any:
        return ("compiled", structured)

    def generate(self, request: GenerateRequest) -> RequestHandle:
        if request.adopt is not None:
            self.submitted.append(time.thread_time())
        handle = RequestHandle(request.request_id, lambda rid, err: None)
        n = len(request.prompt_token_ids)
        if request.prefill_only:
            handle.put(RequestOutput(request.request_id, (42,), " hi", False, None, n, 1,
                                     seed=request.params.seed,
                                     handoff=KvHandoff(tuple(range(n // 16 + 1)), n)))
        else:
            handle.put(RequestOutput(request.request_id, (42,), " hi", False, None, n, 1,
                                     replay=True))
            handle.put(RequestOutput(request.request_id, (43,), " there", True,
                                     FinishReason.LENGTH, n, 2, seed=request.params.seed))
        return handle


def _request(method: str, path: str, body: bytes, headers: dict[str, str]) -> HttpRequest:
    return HttpRequest(method=method, path=path, query="", headers=headers, body=body,
                       disconnected=Signal(), arrival_time=time.monotonic())


def _prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(words)) + f" #{i}"


async def main(requests: int, words: int) -> None:
    tok = Tokenizer(resolve_model(None))
    info = EngineInfo("default", tok.vocab_size, 8192, 8191, max_iter_times=64)
    engine = StubEngine(tok, info)
    p_node = PdNode(PdConfig(infer_mode="dmi", role="prefill"), engine)
    d_node = PdNode(PdConfig(infer_mode="dmi", role="decode"), engine)
    p_router = build_router(engine, pd=p_node)
    d_router = build_router(engine, pd=d_node)

    handed: list[bytes] = []

    async def capture(self: Any) -> None:  # P's POST to D, kept instead of sent
        handed.append(self.decode_parameters().encode())

    prefill.PrefillObserver._send_decode = capture  # type: ignore[method-assign]
    costs: list[float] = []
    tokens: list[int] = []
    for i in range(requests + 3):  # 3 warm-up requests
        body = orjson.dumps({
            "model": "default", "stream": True, "max_tokens": 16,
            "messages": [{"role": "system", "content": "You are a helpful assistant."},
                         {"role": "user", "content": _prompt(i, words)}]})
        headers = {"content-type": "application/json", "req-type": "prefill",
                   "req-id": f"{i + 1:08x}", "d-target": "127.0.0.1;1"}
        p_answer = CaptureResponse()
        await p_router(_request("POST", "/v1/chat/completions", body, headers), p_answer)
        assert p_answer.status == 200 and handed, p_answer.text
        d_answer = CaptureResponse()
        hand_off = handed.pop()
        tokens.append(len(orjson.loads(hand_off)["tokens"]))
        start = time.thread_time()
        await d_router(_request("POST", "/v1/pd/decode", hand_off, {}), d_answer)
        assert b'"isValidDecodeParameters":true' in b"".join(d_answer.chunks), d_answer.text
        if i >= 3:
            costs.append((engine.submitted[-1] - start) * 1e3)
        await asyncio.sleep(0.01)  # D's handler renders and ends (not measured)
    q = statistics.quantiles(costs, n=10)
    print(f"D's event-loop CPU, hand-off received -> engine request submitted, "
          f"{len(costs)} streamed chat requests ({words}-word user message, prompt "
          f"{min(tokens)}-{max(tokens)} tokens): "
          f"median {statistics.median(costs):.3f} ms (p10 {q[0]:.3f}, p90 {q[-1]:.3f})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--words", type=int, default=200, help="words in the user message")
    args = ap.parse_args()
    asyncio.run(main(args.requests, args.words))
