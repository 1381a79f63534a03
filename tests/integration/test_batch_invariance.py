"""Batch invariance on the real model in bf16: a request's logits and tokens do not depend on
what else shares its steps, on how its prompt was chunked, or on the prefix cache.

Two levels:
* the runner (``ModelRunner`` driven step by step by a tiny hand-written schedule): the
  target request's fp32 logits are compared **bit for bit** (``torch.equal``) alone, beside
  random neighbours (decodes and prefills of other lengths), with its prompt in chunks, and
  with its first block taken from the prefix cache;
* the engine (``AsyncEngine`` with its real scheduler): the generated ids, greedy and
  seeded sampled, alone vs among 2..64 random concurrent requests, chunked vs whole
  prefill, prefix-cache hit vs miss.

Both levels run once per weight path this CPU can run (``tests/backends.py``: the bf16
pair-dot GEMM on AVX512_BF16, the bf16 FMA chain, the GGUF blocks); the path is in the test
id and the log line of what each layer ran on is asserted, so the test cannot silently
measure another path.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
import pytest_asyncio
import torch

from tests.backends import gemm_env, weight_paths
from tokenserve.config.tree import EngineConfig
from tokenserve.engine.engine import AsyncEngine
from tokenserve.engine.model_runner import ModelRunner
from tokenserve.messages import GenerateRequest, ScheduledSeq, SeqStart, StepPlan
from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights, resolve_model
from tokenserve.models.tokenizer import Tokenizer
from tokenserve.ops.linear import describe_gemms
from tokenserve.sampling_params import SamplingParams

STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."
BLOCK = 16
DECODE_STEPS = 6


def _chat_ids(tok: Tokenizer, text: str) -> list[int]:
    prompt = tok.apply_chat_template([{"role": "user", "content": text}],
                                     add_generation_prompt=True)
    return tok.encode(prompt, add_special_tokens=False)


# ------------------------------------------------------------------ runner level, bit-exact


class _Seq:
    """A request driven by hand: prompt, generated ids, its own blocks."""

    def __init__(self, rid: str, prompt: list[int], blocks: list[int]) -> None:
        self.rid, self.ids, self.blocks = rid, list(prompt), blocks
        self.num_prompt, self.computed = len(prompt), 0

    def chunk(self, n: int | None = None) -> ScheduledSeq:
        """The next ``n`` unknown tokens (all of them by default)."""
        left = len(self.ids) - self.computed
        n = left if n is None else min(n, left)
        s = ScheduledSeq(self.rid, tuple(self.ids[self.computed:self.computed + n]),
                         self.computed, tuple(self.blocks), self.computed + n == len(self.ids),
                         SamplingParams(seed=0), SeqStart(tuple(self.ids), self.num_prompt))
        self.computed += n
        return s


class _Rig:
    """Runs steps and records the target's logits rows (captured at compute_logits)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.runner = ModelRunner(model, num_blocks=256, block_size=BLOCK)
        self._next_block = itertools.count()

    def new(self, rid: str, prompt: list[int]) -> _Seq:
        nblocks = (len(prompt) + DECODE_STEPS + 2 + BLOCK - 1) // BLOCK
        return _Seq(rid, prompt, [next(self._next_block) for _ in range(nblocks)])

    def step(self, seqs: list[ScheduledSeq], watch: str) -> torch.Tensor | None:
        """Run one step; returns ``watch``'s logits row if it sampled, and appends every
        sampled (greedy) token to its request."""
        rows: list[torch.Tensor] = []
        orig = self.model.compute_logits
        self.model.compute_logits = lambda h: rows.append(orig(h)) or rows[-1]
        try:
            res = self.runner.step(StepPlan(0, seqs))
        finally:
            self.model.compute_logits = orig
        assert not res.failed
        sampled = [s for s in seqs if s.sample]
        out = None
        for i, s in enumerate(sampled):
            if s.request_id == watch:
                out = rows[0][i].clone()
        return out, res.sampled


def _expect_path(line: str, gemm: str, quant: str) -> None:
    """The layers really run on the path under test (``line``: ``describe_gemms``)."""
    if quant == "gguf":  # c: the block GEMM (VNNI/AVX2, AMX-INT8 tiles from 16 rows); amx-bf16
        kernel = "quant_amx" if gemm == "amx-bf16" else "quant_gemm "
        assert kernel in line and "bf16 →" not in line, line
    elif gemm == "c-fma":
        assert line.startswith("bf16 → tokenserve.gemm avx2") or "portable" in line, line
    else:
        assert line.startswith("bf16 → tokenserve.gemm avx512bf16 (invariant)"), line


@pytest.fixture(scope="module", params=weight_paths())
def bf16_model(request):
    gemm, quant = request.param
    d = resolve_model(None)
    cfg = load_config(d)
    with gemm_env(gemm):
        model = CausalLM.from_state_dict(cfg, load_weights(d, torch.bfloat16, quant),
                                                 torch.bfloat16, torch.device("cpu"))
    _expect_path(describe_gemms(model.linears()), gemm, quant)
    return model, Tokenizer(d)


def _run_target(rig: _Rig, target: _Seq, plan_prefill, neighbours=()) -> list[torch.Tensor]:
    """Prefill ``target`` by ``plan_prefill`` (a list of chunk sizes), then decode; each
    step also runs the neighbours' next chunks. Returns the target's logits rows."""
    got = []
    nb = list(neighbours)
    rng = random.Random(7)

    def neighbour_chunks():
        out = []
        for s in nb:
            if s.computed < len(s.ids):
                out.append(s.chunk(rng.choice([1, 3, 7, 50])))
        return out

    for n in plan_prefill:
        seqs = neighbour_chunks() + [target.chunk(n)]
        rng.shuffle(seqs)
        row, sampled = rig.step(seqs, target.rid)
        for s in nb:
            if s.rid in sampled:
                s.ids.append(sampled[s.rid])
        if row is not None:
            got.append(row)
            target.ids.append(sampled[target.rid])
    for _ in range(DECODE_STEPS):
        seqs = neighbour_chunks() + [target.chunk()]
        rng.shuffle(seqs)
        row, sampled = rig.step(seqs, target.rid)
        for s in nb:
            if s.rid in sampled:
                s.ids.append(sampled[s.rid])
        got.append(row)
        target.ids.append(sampled[target.rid])
    return got


def test_logits_bit_identical_alone_batched_chunked_and_cached(bf16_model):
    model, tok = bf16_model
    prompt = _chat_ids(tok, STORY)
    assert len(prompt) > BLOCK + 4
    rng = random.Random(0)

    rig = _Rig(model)
    alone = _run_target(rig, rig.new("t", prompt), [len(prompt)])

    # beside 9 neighbours (fresh prefills of random lengths, in random chunk sizes, so the
    # target shares steps with prefills and decodes of other lengths, in random row order)
    rig = _Rig(model)
    nbrs = [rig.new(f"n{i}", [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 90))])
            for i in range(9)]
    batched = _run_target(rig, rig.new("t", prompt), [len(prompt)], nbrs)

    # prompt in chunks of 5, 13 and the rest
    rig = _Rig(model)
    chunked = _run_target(rig, rig.new("t", prompt), [5, 13, len(prompt) - 18])

    # prefix cache: the first block's K/V come from another request with the same prefix
    rig = _Rig(model)
    donor = rig.new("d", prompt[:BLOCK] + [rng.randrange(100, 40000) for _ in range(5)])
    rig.step([donor.chunk()], "d")
    target = rig.new("t", prompt)
    target.blocks[0] = donor.blocks[0]
    target.computed = BLOCK  # a prefix-cache hit skips the cached block's tokens
    cached = _run_target(rig, target, [len(prompt) - BLOCK])

    assert len(alone) == DECODE_STEPS + 1
    for name, rows in (("batched", batched), ("chunked", chunked), ("prefix-cached", cached)):
        assert len(rows) == len(alone), name
        for step, (a, b) in enumerate(zip(alone, rows)):
            assert a.dtype == torch.float32
            assert torch.equal(a, b), f"{name}: logits differ at step {step} " \
                                      f"(max |diff| {(a - b).abs().max().item():.3g})"


# ------------------------------------------------------------------ engine level, token ids


_ids = itertools.count()


def _engine_cfg(**kw) -> EngineConfig:
    base = dict(dtype="bfloat16", device="cpu", block_size=BLOCK, kv_cache_bytes=128 << 20,
                max_batch_size=80, max_num_batched_tokens=2048)
    base.update(kw)
    return EngineConfig(**base)


async def _generate(engine: AsyncEngine, ids: list[int], cached: list | None = None,
                    **params) -> list[int]:
    """The generated ids; appends the prompt tokens served from the prefix cache to
    ``cached`` when given."""
    g = GenerateRequest(f"inv-{next(_ids)}", tuple(ids),
                        SamplingParams(**{"max_new_tokens": 12, "ignore_eos": True, **params}))
    out = []
    async for o in engine.generate(g):
        out += o.new_token_ids
        assert o.error is None, o.error
        if o.finished and cached is not None:
            cached.append(o.num_cached_tokens)
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=weight_paths())
async def engines(request):
    """Two bf16 engines on one weight path: the default whole-prompt path with the prefix
    cache on, and chunked prefill in 7-token steps with no prefix cache."""
    gemm, quant = request.param
    made = []
    for kw in (dict(max_num_batched_tokens=2048, enable_prefix_caching=True),
               dict(max_num_batched_tokens=7, long_prefill_token_threshold=7,
                    enable_prefix_caching=False)):
        with gemm_env(gemm):
            e = await asyncio.to_thread(AsyncEngine.build,
                                        _engine_cfg(quantization=quant, **kw))
        _expect_path(e.info.gemm, gemm, quant)
        await e.start()
        made.append(e)
    yield made
    for e in made:
        await e.stop()


PARAMS = [dict(do_sample=False), dict(do_sample=True, seed=1234, temperature=0.9, top_k=40,
                                      top_p=0.95)]


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
async def test_tokens_identical_alone_batched_chunked_cached(engines, params):
    whole, chunked = engines
    tok = whole.tokenizer
    prompt = _chat_ids(tok, STORY)
    alone = await _generate(whole, prompt, **params)
    # the prefix cache now holds the prompt's full blocks: this is a cache hit
    hits: list[int] = []
    cached = await _generate(whole, prompt, cached=hits, **params)
    assert hits[0] >= BLOCK, "expected a prefix-cache hit"
    in_chunks = await _generate(chunked, prompt, **params)
    assert cached == alone, "prefix-cache hit changed the tokens"
    assert in_chunks == alone, "chunked prefill changed the tokens"

    rng = random.Random(11)
    for n in (2, 9, 64):
        others = [[rng.randrange(100, 40000) for _ in range(rng.randrange(1, 60))]
                  for _ in range(n - 1)]
        other_params = [dict(do_sample=rng.random() < 0.5, seed=rng.randrange(1 << 30),
                             max_new_tokens=rng.randrange(1, 16)) for _ in others]
        results = await asyncio.gather(
            _generate(whole, prompt, **params),
            *(_generate(whole, o, **p) for o, p in zip(others, other_params)))
        assert results[0] == alone, f"tokens changed in a batch of {n}"
    for e in engines:
        await e.wait_idle(timeout=30)
        st = e.stats()
        assert st.num_free_blocks == st.num_blocks, "KV blocks leaked"
