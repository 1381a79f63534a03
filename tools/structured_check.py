"""The structured-output must-shows of issue 23 on the real default model, once (minutes):

1. ``openai`` SDK ``client.beta.chat.completions.parse(response_format=<pydantic model>)``
   on 50 varied prompts: how many come back parsed.
2. 200 ``json_schema`` ``strict`` requests (temperature 1, seeds 0..199, even seeds
   streamed), 16 at a time: how many validate against the schema (``jsonschema``).
3. Greedy constrained outputs alone vs in one batch of 64 mixed constrained and
   unconstrained requests: how many are identical.
4. p99 inter-token latency of 16 concurrent unconstrained streams, alone and while
   pathological constrained requests run (long maxLength, many maxItems, recursive
   schema, a regex blow-up, a too-deep schema that is refused).

Run: ``PYTHONPATH=. python tools/structured_check.py [--dtype bfloat16] [--parse 50]
[--validate 200]``. It serves the engine in-process on a loopback port (as the
integration tests do) and prints one line per check; exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Annotated

import httpx
import jsonschema
import openai
from pydantic import BaseModel, Field

from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.server.app import serve

ITEMS = ["a bicycle", "a teapot", "a laptop", "a used car", "a guitar", "a tent", "a watch",
         "a sofa", "a camera", "a kayak"]
ASKS = ["Describe {} for sale as JSON.", "Give a shop listing for {}.",
        "Write a product card for {}.", "Invent a catalogue entry for {}.",
        "Fill in the product record for {}."]


class Product(BaseModel):
    """Bounded fields (as a careful schema author writes them): the grammar ends the
    answer even when the 135M model would repeat itself."""

    name: str = Field(max_length=40)
    price: int = Field(ge=0, le=100_000)
    tags: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
    in_stock: bool


PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 15}}}}


async def check_parse(sdk, model: str, n: int) -> tuple[int, int]:
    ok = 0
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> bool:
        prompt = ASKS[i % len(ASKS)].format(ITEMS[i % len(ITEMS)])
        async with sem:
            try:
                r = await sdk.beta.chat.completions.parse(
                    model=model, response_format=Product, seed=i, max_tokens=200,
                    messages=[{"role": "user", "content": prompt}])
            except openai.OpenAIError as exc:
                print(f"  parse {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return False
        return isinstance(r.choices[0].message.parsed, Product)

    ok = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return ok, n


async def check_validate(sdk, model: str, n: int) -> tuple[int, int]:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    sem = asyncio.Semaphore(16)

    async def one(seed: int) -> bool:
        kw = {"model": model, "response_format": fmt, "temperature": 1.0, "seed": seed,
              "max_tokens": 200, "messages": [{"role": "user", "content":
                                                f"Invent user number {seed} of a shop."}]}
        async with sem:
            if seed % 2:
                r = await sdk.chat.completions.create(**kw)
                text = r.choices[0].message.content
            else:
                parts = []
                async for c in await sdk.chat.completions.create(stream=True, **kw):
                    if c.choices and c.choices[0].delta.content:
                        parts.append(c.choices[0].delta.content)
                text = "".join(parts)
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError) as exc:
            print(f"  validate {seed}: {exc!s:.200} in {text!r:.200}", file=sys.stderr)
            return False
        return True

    return sum(await asyncio.gather(*(one(s) for s in range(n)))), n


async def check_batch_invariance(http: httpx.AsyncClient, model: str) -> tuple[int, int]:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def body(i: int, constrained: bool) -> dict:
        b = {"model": model, "temperature": 0, "max_tokens": 64,
             "messages": [{"role": "user", "content": f"Invent user number {i} of a shop."}]}
        if constrained:
            b["response_format"] = fmt
        return b

    async def text(b: dict) -> str:
        r = await http.post("/v1/chat/completions", json=b)
        r.raise_for_status()
        return r.json()["choices"][0]["message"]["content"]

    probes = [body(i, True) for i in range(8)]
    alone = [await text(b) for b in probes]
    mixed = probes + [body(100 + i, i % 2 == 0) for i in range(56)]
    together = await asyncio.gather(*(text(b) for b in mixed))
    return sum(a == t for a, t in zip(alone, together[:8])), len(probes)


async def itl_p99(http: httpx.AsyncClient, model: str) -> float:
    """p99 gap (ms) between SSE events of 16 concurrent unconstrained streams."""
    gaps: list[float] = []

    async def one(i: int) -> None:
        b = {"model": model, "temperature": 0, "max_tokens": 48, "ignore_eos": True,
             "stream": True, "messages": [{"role": "user", "content": f"Story {i}."}]}
        last = None
        async with http.stream("POST", "/v1/chat/completions", json=b) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and "[DONE]" not in line:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1e3)
                    last = now

    await asyncio.gather(*(one(i) for i in range(16)))
    gaps.sort()
    return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]


def pathological() -> list[dict]:
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    return [
        {"type": "object", "required": ["s"], "properties": {
            "s": {"type": "string", "minLength": 5000, "maxLength": 100_000}}},
        {"type": "array", "minItems": 1000, "maxItems": 100_000,
         "items": {"type": "string", "maxLength": 1000}},
        {"$defs": {"n": {"type": "object", "required": ["v", "kids"], "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
         "$ref": "#/$defs/n"},
        {"type": "string", "pattern": "^([a-z]{1,300}[0-9]{1,300}){1,300}$"},
        deep,
    ]


async def check_itl(http: httpx.AsyncClient, model: str
                    ) -> tuple[float, float, float, list[int]]:
    """p99 ITL of the 16 streams alone, beside the same number of extra unconstrained
    requests (the control: extra rows in the batch cost what they cost), and beside the
    pathological constrained ones."""
    base = await itl_p99(http, model)
    statuses: list[int] = []

    async def extra(schema: dict | None) -> None:
        body = {"model": model, "max_tokens": 64,
                "messages": [{"role": "user", "content": "Go."}]}
        if schema is not None:
            body["guided_json"] = json.dumps(schema)
        r = await http.post("/v1/chat/completions", json=body)
        if schema is not None:
            statuses.append(r.status_code)

    bg = asyncio.gather(*(extra(None) for _ in pathological()))
    control = await itl_p99(http, model)
    await bg
    bg = asyncio.gather(*(extra(s) for s in pathological()))
    loaded = await itl_p99(http, model)
    await bg
    return base, control, loaded, statuses


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--parse", type=int, default=50)
    ap.add_argument("--validate", type=int, default=200)
    args = ap.parse_args()
    engine = await asyncio.to_thread(AsyncEngine.build, EngineConfig(
        dtype=args.dtype, device="cpu", max_batch_size=80))
    await engine.start()
    started: asyncio.Future = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(engine, "127.0.0.1", 0, started=started))
    url = f"http://127.0.0.1:{(await started).ports[0]}"
    model = engine.model_name
    sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1800)
    failed = False
    async with httpx.AsyncClient(base_url=url, timeout=1800) as http:
        t0 = time.perf_counter()
        ok, n = await check_parse(sdk, model, args.parse)
        print(f"parse (openai SDK, pydantic): {ok}/{n} parsed [{time.perf_counter() - t0:.0f} s]")
        failed |= ok != n
        t0 = time.perf_counter()
        ok, n = await check_validate(sdk, model, args.validate)
        print(f"strict json_schema, temperature 1, 16 at a time: {ok}/{n} validate "
              f"[{time.perf_counter() - t0:.0f} s]")
        failed |= ok != n
        ok, n = await check_batch_invariance(http, model)
        print(f"greedy constrained, alone vs in a batch of 64 mixed: {ok}/{n} identical")
        failed |= ok != n
        base, control, loaded, statuses = await check_itl(http, model)
        print(f"p99 ITL of 16 unconstrained streams: {base:.1f} ms alone, {control:.1f} ms "
              f"beside {len(statuses)} unconstrained requests, {loaded:.1f} ms beside "
              f"{len(statuses)} pathological constrained ones (their statuses: "
              f"{sorted(statuses)})")
        st = engine.stats()
        if st.mask_steps:
            print(f"mask cost: {st.mask_ms / st.mask_steps:.3f} ms per constrained step "
                  f"over {st.mask_steps} steps")
    await sdk.close()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await engine.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
