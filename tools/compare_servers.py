"""Send the same requests to two servers and report every answer that differs.

Every family's inference routes (whole and streamed, greedy), their other routes, and bad
input; each answer is compared on status, content type and body, with the fields that
differ between any two runs (ids, creation times, timings) blanked. Use it to check that a
refactor keeps every route's bytes (old build vs new), or that a PD coordinator answers as
a mixed server does (the parity check of issue 22):

    python tools/compare_servers.py http://127.0.0.1:1025 http://127.0.0.1:2025 [--model NAME]

A mixed server and a 1 P + 1 D cluster of the default model on one machine, the settings
of tests/integration/conftest.py ``LIVE_FLAGS`` (fp32: seeded sampling is batch invariant,
so seeded answers match token for token)::

    F="--dtype float32 --block-size 16 --kv-cache-bytes 134217728 --max-batch-size 32
       --max-num-batched-tokens 2048"
    OMP_NUM_THREADS=1 tokenserve serve --port 1025 $F &
    OMP_NUM_THREADS=1 tokenserve serve --port 1031 $F --role prefill &
    OMP_NUM_THREADS=1 tokenserve serve --port 1032 $F --role decode &
    tokenserve coordinator --port 2025 --prefill 127.0.0.1:1031 --decode 127.0.0.1:1032 &

Besides the blanked comparison, every streamed answer must carry one ``id`` in all its
events (a PD stream once changed id at the P -> D hand-off).

``n`` = 2 (issue 40: the coordinator splits such a request into single-sequence ones and
merges their answers, tokenserve/coordinator/fanout.py): OpenAI completions and chat and
vLLM ``/generate``, whole and streamed, pinned (``top_k`` 1: every choice is the greedy
answer) or seeded (choice ``i`` samples with ``seed + i`` on both servers), as
tests/integration/test_pd_n.py compares them. A stream of several choices is compared
choice by choice (each choice's text, role and finish reason concatenated over its
events, in order) plus the sequence of its events with the choices left out (consecutive
equal ones counted once: usage only on the last chunk, one ``[DONE]``), not on how its
events interleave the choices or split the text. vLLM lists a whole answer's sequences
best first on a mixed server and in seed order through the coordinator ([I],
fanout.py): its texts are compared as sorted lists.

The :data:`STATUS_ONLY` paths (``/metrics``) are compared on status and content type only:
their numbers differ by design. Their request counters do not: ``/metrics`` is scraped on
both servers before and after each of :func:`request_sets` (n = 1, then n = 2), and the
deltas of MindIE's per-request series (:data:`COUNTERS`: received, success, failed,
disconnected, and the TTFT and e2e histograms' counts, each request counted once) must
be equal; on the coordinator these are the cluster's un-prefixed series, not the
instances' ``instance_*`` ones (both servers must serve nobody else meanwhile;
``--no-counters`` skips this). Exit status 1 when any answer or delta differs.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

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
    """Every request, in order: (method, path, json body or raw bytes or None)."""
    return [r for _, reqs in request_sets(model) for r in reqs]


def request_sets(model: str) -> list[tuple[str, list[tuple[str, str, Any]]]]:
    """The requests in the sets whose counter deltas are compared one by one: one
    sequence each, then ``n`` = 2 (:func:`several`)."""
    return [("n = 1", single(model)), ("n = 2", several(model))]


def single(model: str) -> list[tuple[str, str, Any]]:
    """One sequence a request (and the routes that are not inference)."""
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


def several(model: str) -> list[tuple[str, str, Any]]:
    """``n`` = 2 (issue 40), the bodies of tests/integration/test_pd_n.py: pinned
    (``top_k`` 1, sampled: both choices are the greedy answer) and seeded (choice ``i``
    with ``seed + i``); and greedy ``n`` = 2, which both servers refuse (422)."""
    p = "The three primary colours are"
    chat = [{"role": "user", "content": "Name a fruit."}]
    usage = {"stream_options": {"include_usage": True}}
    pinned = {"n": 2, "temperature": 1.0, "top_k": 1}
    cmpl = {"model": model, "prompt": p, "max_tokens": 10}
    chats = {"model": model, "messages": chat, "max_tokens": 10}
    gen = {"prompt": "Name a colour.", "max_tokens": 8}
    seeded = {**gen, "n": 2, "temperature": 0.9, "seed": 7}
    return [
        ("POST", "/v1/completions", {**cmpl, **pinned, "seed": 5}),
        ("POST", "/v1/completions", {**cmpl, **pinned, "seed": 5, "stream": True}),
        ("POST", "/v1/completions", {**cmpl, "n": 2, "temperature": 1.0, "seed": 123}),
        ("POST", "/v1/completions", {**cmpl, "n": 2, "temperature": 1.0, "seed": 123,
                                     "stream": True, **usage}),
        ("POST", "/v1/chat/completions", {**chats, **pinned, "seed": 9}),
        ("POST", "/v1/chat/completions", {**chats, **pinned, "seed": 9, "stream": True,
                                          **usage}),
        ("POST", "/v1/chat/completions", {**chats, "n": 2, "temperature": 1.0, "seed": 9}),
        ("POST", "/v1/chat/completions", {**chats, "n": 2, "temperature": 1.0, "seed": 9,
                                          "stream": True}),
        ("POST", "/generate", {**gen, **pinned, "seed": 3}),
        ("POST", "/generate", seeded),
        ("POST", "/generate", {**seeded, "stream": True}),
        ("POST", "/v1/completions", {**cmpl, "n": 2, "temperature": 0}),  # 422 on both
    ]


#: routes compared on status and content type only (their numbers differ by design)
STATUS_ONLY = frozenset({"/metrics"})


def _n_of(body: Any) -> int:
    n = body.get("n", 1) if isinstance(body, dict) else 1
    return n if isinstance(n, int) else 1


def _add(acc: dict[str, Any], key: str, value: Any) -> None:
    """Strings concatenated, lists extended, anything else appended; a None only marks
    that the key was there (``"logprobs": null`` is not a missing ``logprobs``)."""
    if value is None:
        acc.setdefault(key, None)
    elif isinstance(value, str):
        acc[key] = (acc.get(key) or "") + value
    else:
        if acc.get(key) is None:
            acc[key] = []
        if isinstance(value, list):
            acc[key].extend(value)
        else:
            acc[key].append(value)


def _several(path: str, norm: Any) -> Any:
    """An answer of several sequences (after :func:`_normalise`), independent of how a stream
    interleaves its choices and splits their text; vLLM's sequences sorted (module
    docstring)."""
    vllm = path == "/generate"
    if isinstance(norm, dict):  # a whole answer
        if vllm and isinstance(norm.get("text"), list):
            return {**norm, "text": sorted(norm["text"], key=str)}
        if isinstance(norm.get("choices"), list):
            return {**norm, "choices": sorted(norm["choices"], key=lambda c: str(
                c.get("index") if isinstance(c, dict) else c))}
        return norm
    if not isinstance(norm, list):
        return norm
    choices: dict[Any, dict[str, Any]] = {}
    frames: list[Any] = []
    for kind, obj in norm:
        frame: Any = (kind, obj)
        if isinstance(obj, dict):  # an SSE event's or a NUL-framed chunk's JSON
            rest = dict(obj)
            if isinstance(obj.get("choices"), list):
                rest["choices"] = "[]" if not obj["choices"] else "*"
                for c in obj["choices"]:
                    if not isinstance(c, dict):
                        continue
                    acc = choices.setdefault(str(c.get("index")), {})
                    for k, v in c.items():
                        if k == "delta" and isinstance(v, dict):
                            for dk, dv in v.items():
                                _add(acc, f"delta.{dk}", dv)
                        elif k != "index":
                            _add(acc, k, v)
            elif vllm and isinstance(obj.get("text"), list):
                rest["text"] = "*"
                for i, t in enumerate(obj["text"]):
                    _add(choices.setdefault(str(i), {}), "text", t)
            frame = (kind, rest)
        if not frames or frames[-1] != frame:
            frames.append(frame)
    merged: Any = choices
    if vllm:
        merged = sorted(orjson.dumps(c, option=orjson.OPT_SORT_KEYS).decode()
                        for c in choices.values())
    return {"events": frames, "choices": merged}


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
    if _n_of(body) > 1:
        return r.status_code, ctype, _several(path, _normalise(r.content))
    return r.status_code, ctype, _normalise(r.content)


#: MindIE's per-request series (spec/interfaces.md §7.7): each request counted once, on a
#: mixed server and, under these un-prefixed names, on the coordinator
#: (tests/integration/test_metrics_disconnects.py, tests/unit/test_pd_manage.py)
COUNTERS = ("request_received_total", "request_success_total", "request_failed_total",
            "request_disconnected_total", "time_to_first_token_seconds_count",
            "e2e_request_latency_seconds_count")


def counters(text: str) -> dict[str, float]:
    """:data:`COUNTERS` in a ``/metrics`` text, each summed over its samples of exactly
    that name (the coordinator's ``instance_*`` series are other names)."""
    out = dict.fromkeys(COUNTERS, 0.0)
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def settled_counters(client: httpx.Client, base: str, timeout_s: float = 30.0,
                     poll_s: float = 0.2) -> dict[str, float]:
    """:func:`counters` once nothing is in flight (received == success + failed) and two
    scrapes ``poll_s`` apart agree (a handler records its end just after its answer), or
    the last scrape after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    prev: dict[str, float] | None = None
    while True:
        r = client.get(base + "/metrics")
        r.raise_for_status()
        now = counters(r.text)
        idle = now["request_received_total"] == (now["request_success_total"]
                                                 + now["request_failed_total"])
        if (idle and now == prev) or time.monotonic() > deadline:
            return now
        prev = now
        time.sleep(poll_s)


def compare(client: httpx.Client, a: str, b: str, model: str, *,
            count: bool = True, out: Any = None) -> tuple[int, int]:
    """Every request to ``a`` and ``b`` and, with ``count``, :data:`COUNTERS`' deltas
    over each of :func:`request_sets` (a difference then says which kind of request is
    counted differently); each differing answer printed to ``out``. Returns (differing,
    compared)."""
    out = out or sys.stdout
    differ = total = 0
    if count:
        before = (settled_counters(client, a), settled_counters(client, b))
    for label, reqs in request_sets(model):
        for method, path, body in reqs:
            ra = fetch(client, a, method, path, body)
            rb = fetch(client, b, method, path, body)
            what = f"{method} {path} {str(body)[:60]}"
            total += 1
            if ra == rb:
                print(f"same    {ra[0]} {what}", file=out)
            else:
                differ += 1
                print(f"DIFFERS {what}\n  A: {str(ra)[:600]}\n  B: {str(rb)[:600]}",
                      file=out)
        if not count:
            continue
        after = (settled_counters(client, a), settled_counters(client, b))
        for name in COUNTERS:
            da, db = (after[i][name] - before[i][name] for i in (0, 1))
            total += 1
            if da == db:
                print(f"same    delta {name} ({label}) {da:g}", file=out)
            else:
                differ += 1
                print(f"DIFFERS delta {name} ({label})\n  A: {da:g}\n  B: {db:g}", file=out)
        before = after
    return differ, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--model", default=None, help="default: the first of A's /v1/models")
    ap.add_argument("--no-counters", action="store_true",
                    help="do not compare the /metrics request counters' deltas")
    args = ap.parse_args(argv)
    with httpx.Client(timeout=300) as client:
        model = args.model or client.get(args.a + "/v1/models").json()["data"][0]["id"]
        differ, total = compare(client, args.a, args.b, model, count=not args.no_counters)
    print(f"{total - differ} of {total} answers the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
