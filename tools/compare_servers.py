"""Send the same requests to two servers and report every answer that differs.

Every family's inference routes (whole and streamed, greedy), their other routes, and bad
input; each answer is compared on status, content type and body, with the fields that
differ between any two runs (ids, creation times, timings) blanked. Use it to check that a
refactor keeps every route's bytes (old build vs new), or that a PD coordinator answers as
a mixed server does:

    python tools/compare_servers.py http://127.0.0.1:1025 http://127.0.0.1:2025 [--model NAME]

Exit status 1 when any answer differs.
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
    ]
    return out


def fetch(client: httpx.Client, base: str, method: str, path: str, body: Any
          ) -> tuple[int, str, Any]:
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    elif body is not None:
        kw = {"json": body}
    r = client.request(method, base + path, **kw)
    return r.status_code, r.headers.get("content-type", ""), _normalise(r.content)


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
