"""Greedy outputs with speculative decoding on and off, byte for byte (issue 25).

    python -m bench.spec_identity [--num-prompts 200] [--max-new-tokens 64]
        [--concurrency 1,16] [--speculative-config JSON]

Builds the default engine twice in this process (drafts off, then on: ``max_draft_rows``
raised to the concurrency so drafts are really made under load), sends the same prompts
to both (the repeat-heavy workload, ``tokenserve/loadgen/passages_repeat.json``, and the
chat questions of ``bench/prompts_accuracy.json``, cycled to ``--num-prompts``), and
reports per concurrency how many outputs are identical, tokens/s of each, and accepted /
drafted.
Exits 1 when any output differs.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

from tokenserve.loadgen.workload import PASSAGES

_ids = itertools.count()


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts: instruction x passage, then the accuracy study's questions."""
    data = json.loads(PASSAGES.read_text())
    texts = [i.format(p) for i in data["instructions"] for p in data["passages"]]
    acc = json.loads(Path(__file__).with_name("prompts_accuracy.json").read_text())
    texts += [p["text"] for p in acc["prompts"]]
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": t}], add_generation_prompt=True), add_special_tokens=False)
        for t in itertools.islice(itertools.cycle(texts), n)]


async def run(engine, ps: list[list[int]], max_new: int, concurrency: int
              ) -> tuple[list[list[int]], float]:
    from tokenserve.messages import GenerateRequest
    from tokenserve.sampling_params import SamplingParams

    sem = asyncio.Semaphore(concurrency)

    async def one(p):
        async with sem:
            out = []
            g = GenerateRequest(f"id-{next(_ids)}", tuple(p),
                                SamplingParams(max_new_tokens=max_new, do_sample=False))
            async for o in engine.generate(g):
                out += o.new_token_ids
            return out
    t = time.perf_counter()
    outs = await asyncio.gather(*(one(p) for p in ps))
    return outs, time.perf_counter() - t


async def main(argv: list[str] | None = None) -> int:
    from tokenserve.config.tree import EngineConfig
    from tokenserve.engine.engine import AsyncEngine
    from tokenserve.config.tree import SpecConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--speculative-config",
                    default='{"method": "ngram", "num_speculative_tokens": 8, '
                            '"prompt_lookup_max": 5}')
    a = ap.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    spec = SpecConfig.from_dict({**json.loads(a.speculative_config),
                                 "max_draft_rows": max(levels)})
    results = {}
    for name, sc in (("off", None), ("on", spec)):
        engine = await asyncio.to_thread(AsyncEngine.build, EngineConfig(speculative_config=sc))
        await engine.start()
        ps = prompts(engine.tokenizer, a.num_prompts)
        for c in levels:
            before = engine.stats()
            outs, secs = await run(engine, ps, a.max_new_tokens, c)
            st = engine.stats()
            results[name, c] = (outs, secs, st.num_draft_tokens - before.num_draft_tokens,
                                st.num_accepted_tokens - before.num_accepted_tokens)
        await engine.stop()
    bad = 0
    for c in levels:
        off, on = results["off", c], results["on", c]
        same = sum(x == y for x, y in zip(off[0], on[0]))
        bad += len(off[0]) - same
        n = sum(map(len, off[0]))
        print(f"c={c}: {same}/{len(off[0])} identical; {n} tokens; off {n / off[1]:.1f} tok/s, "
              f"on {n / on[1]:.1f} tok/s ({off[1] / on[1]:.2f}x); accepted/drafted "
              f"{on[3]}/{on[2]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
