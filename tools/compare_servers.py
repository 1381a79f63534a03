"""Send the same requests to two servers and report every answer that differs.

Every family's inference routes (whole and streamed, greedy), their other routes, and bad
input; each answer is compared on status, content type and body, with the fields that
differ between any two runs (ids, creation times, timings) blanked. Use it to check that a
refactor keeps every route's bytes (old build vs new), or that a PD coordinator answers as
a mixed server does (the parity check of issue 22):

    python tools/compare_servers.py http://127.0.0.1:1025 http://127.0.0.1:2025 [--model NAME]

Besides the blanked comparison, every streamed answer must carry one ``id`` in all its
events (a PD stream once changed id at the P -> D hand-off). ``--status-only`` paths
(``/metrics``) are compared on status and content type only: their counters differ by
design. Exit status 1 when any answer differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import httpx
import orjson

#: keys whose values differ between two runs of the same greedy request
VOLATILE = {"id", "created", "system_fingerprint", "prefill_time", "decode_time",
            "queue_time", "inference_time", "timestamp", "request_id", "reqId",
            "model_version", "seed"}


def _blank(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ("*" if k in VOLATILE else _blank(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_blank(v) for v in obj]
    return obj


def _normalise(body: bytes) -> Any:
    """JSON bodies and SSE / NUL-framed streams with volatile fields blanked."""
    try:
        return _blank(orjson.loads(body))
    except orjson.JSONDecodeError:
        pass
    text = body.decode("utf-8", "replace")
    parts = re.split(r"\n\n|\0", text)
    out = []
    for part in parts:
        payload = part[5:].lstrip() if part.startswith("data:") else part
        try:
            out.append(("data" if part.startswith("data:") else "raw",
                        _blank(orjson.loads(payload))))
        except orjson.JSONDecodeError:
            out.append(("raw", part))
    return out


def requests(model: str) -> list[tuple[str, str, Any]]:
    """(method, path, json body or raw bytes or None)."""
    p = "Write one sentence about the sea."
    m = f"/v2/models/{model}"
    gen = {"max_new_tokens": 12}
    chat = [{"role": "user", "content": p}]
    emoji = [{"role": "user", "content": "Reply with only the emoji 🌊🐳 and nothing else."}]
    oai = {"model": model, "max_tokens": 12, "temperature": 0}  # OpenAI samples by default
    out: list[tuple[str, str, Any]] = [
        ("POST", "/infer", {"inputs": p, "parameters": gen, "stream": False}),
        ("POST", "/infer", {"inputs": p, "parameters": gen, "stream": True}),
        ("POST", "/infer_token", {"input_id": [1, 2, 3, 4], "parameters": gen}),
        ("POST", "/generate", {"inputs": p, "parameters": {**gen, "details": True}}),
        ("POST", "/generate", {"prompt": p, "max_tokens": 12, "temperature": 0}),
        ("POST", "/generate", {"prompt": p, "max_tokens": 12, "stream": True}),
        ("POST", "/generate_stream", {"inputs": p, "parameters": {**gen, "details": True}}),
        ("POST", "/", {"inputs": p, "parameters": gen, "stream": True}),
        ("POST", "/v1/completions", {**oai, "prompt": p, "logprobs": 2}),
        ("POST", "/v1/completions", {**oai, "prompt": p, "stream": True}),
        ("POST", "/v1/chat/completions", {**oai, "messages": chat, "logprobs": True,
                                          "top_logprobs": 2}),
        ("POST", "/v1/chat/completions", {**oai, "messages": chat, "stream": True,
                                          "stream_options": {"include_usage": True}}),
        # logprobs across the P -> D hand-off, a character split over two tokens there
        ("POST", "/v1/chat/completions", {**oai, "messages": emoji, "stream": True,
                                          "logprobs": True, "top_logprobs": 2,
                                          "stream_options": {"include_usage": True}}),
        ("POST", "/v1/chat/completions", {**oai, "messages": emoji, "logprobs": True,
                                          "top_logprobs": 2}),
        ("POST", "/v1/completions", {**oai, "prompt": p, "stream": True, "logprobs": 2}),
        ("POST", "/v1/completions", {**oai, "prompt": p, "echo": True, "logprobs": 1}),
        ("POST", "/infer", {"inputs": p, "stream": True,
                            "parameters": {**gen, "details": True}}),
        ("POST", "/generate", {"inputs": p, "parameters": {
            **gen, "details": True, "decoder_input_details": True, "top_n_tokens": 2}}),
        ("POST", f"{m}/generate", {"text_input": p, "parameters": gen}),
        ("POST", f"{m}/generate_stream", {"text_input": p, "parameters": gen}),
        ("POST", f"{m}/infer", {"id": "a1", "inputs": [{"name": "input0", "shape": [1, 4],
                                                        "datatype": "UINT32",
                                                        "data": [1, 2, 3, 4]}],
                                "outputs": [{"name": "output0"}],
                                "parameters": {"max_new_tokens": 12}}),
        ("POST", "/v1/tokenizer", {"inputs": p}),
        ("GET", "/v1/models", None), ("GET", f"/v1/models/{model}", None),
        ("GET", "/info", None), ("GET", "/v2", None), ("GET", m, None),
        ("GET", f"{m}/config", None), ("GET", f"{m}/ready", None),
        ("GET", "/v2/models/no-such-model/ready", None),
        ("GET", "/v2/health/ready", None), ("GET", "/v2/health/live", None),
        ("GET", "/health", None), ("GET", "/v1/config", None),
        # bad input, in each family's shape
        ("POST", "/infer", {}), ("POST", "/infer", b"{not json"),
        ("POST", "/generate", {}), ("POST", "/generate", {"inputs": 3}),
        ("POST", "/generate_stream", {"inputs": p, "parameters": {"max_new_tokens": -1}}),
        ("POST", "/v1/completions", {"model": model, "prompt": p, "max_tokens": "x"}),
        ("POST", "/v1/chat/completions", {"model": model, "messages": 3}),
        ("POST", "/v1/chat/completions", {"model": "nope", "messages": chat}),
        ("POST", f"{m}/generate", {"parameters": gen}),
        ("POST", f"{m}/infer", {"inputs": []}),
        ("GET", "/infer", None), ("GET", "/no/such/route", None),
        ("POST", f"{m}/stopInfer", {"id": "no-such-request"}),
        ("POST", f"{m}/stopInfer", {"id": "bad id!"}),
        ("POST", "/v1/chat/completions", {**oai, "messages": chat, "stream": True,
                                          "max_tokens": 0}),
        ("GET", "/metrics", None),
    ]
    return out


#: routes compared on status and content type only (their numbers differ by design)
STATUS_ONLY = frozenset({"/metrics"})


def stream_ids(body: bytes) -> set[str]:
    """The distinct ``id`` values of a stream's events (empty for a whole answer)."""
    ids: set[str] = set()
    for part in re.split(rb"\n\n|\0", body):
        payload = part[5:].lstrip() if part.startswith(b"data:") else part
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("id"), str):
            ids.add(obj["id"])
    return ids


def fetch(client: httpx.Client, base: str, method: str, path: str, body: Any
          ) -> tuple[int, str, Any]:
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    r = client.request(method, base + path, **kw)
    ctype = r.headers.get("content-type", "")
    if path in STATUS_ONLY:
        return r.status_code, ctype, None
    if ctype.startswith("text/event-stream") and len(stream_ids(r.content)) > 1:
        return r.status_code, ctype, ("ids differ within one stream",
                                      sorted(stream_ids(r.content)))
    return r.status_code, ctype, _normalise(r.content)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--model", default=None, help="default: the first of A's /v1/models")
    args = ap.parse_args(argv)
    with httpx.Client(timeout=120) as client:
        model = args.model or client.get(args.a + "/v1/models").json()["data"][0]["id"]
        differ = 0
        reqs = requests(model)
        for method, path, body in reqs:
            a = fetch(client, args.a, method, path, body)
            b = fetch(client, args.b, method, path, body)
            what = f"{method} {path} {str(body)[:60]}"
            if a == b:
                print(f"same    {a[0]} {what}")
            else:
                differ += 1
                print(f"DIFFERS {what}\n  A: {str(a)[:600]}\n  B: {str(b)[:600]}")
    print(f"{len(reqs) - differ} of {len(reqs)} answers the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
