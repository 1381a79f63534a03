"""Micro-benchmark of CPU paged attention (``csrc/attention.cpp``) against the engine's
pure-torch path.

    python bench/kernels_attention.py [--threads N]

SmolLM2-135M attention shapes (H=9 query heads, Hkv=3 kv heads, head_dim 64), bf16,
block size 128, per layer:

- decode (batch, context): ours reads K/V in place from a ``[num_blocks, Hkv, bs, D]``
  cache; the baseline is today's engine decode path (``tokenserve.models.attention``) on a
  cache in the engine's current ``[num_blocks, bs, Hkv, D]`` layout: ``index_select`` of
  every context slot from the flat cache into ``[n, L, Hkv, D]``, transpose, then
  ``F.scaled_dot_product_attention(..., attn_mask, enable_gqa=True)`` with the additive
  padding mask the engine always passes (all zeros here: equal contexts, no padding).
- prefill (1024 tokens, no cached prefix): ours vs ``F.scaled_dot_product_attention(
  is_causal=True, enable_gqa=True)`` on the fresh ``[1, H, L, D]`` views (the engine's path).
- decode step (64 rows, context 80, 30 layers): the 30 calls on their own caches, as in the
  server, vs on one cache reused: what the KV reads cost beyond the arithmetic.
- decode step on the int8 KV cache (the server's default on a CPU: rows of int8 and an fp32
  scale, ``quantize_kv_rows``) vs the same step on the bf16 cache.

Blocks of each sequence are scattered in random order. Times are the best of several runs
(the host is shared; the minimum is the least noisy).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.layer_ref import quantize_kv_rows

H, HKV, D, BS = 9, 3, 64, 128
DTYPE = torch.bfloat16
DECODES = ((32, 1024), (1, 128), (64, 256))
PREFILL = 1024


def _time_ms(fn, budget_s: float = 0.5, min_reps: int = 3, max_reps: int = 100) -> float:
    fn()  # warm-up
    best, spent, reps = float("inf"), 0.0, 0
    while reps < min_reps or (spent < budget_s and reps < max_reps):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best * 1e3


def _setup(batch: int, ctx: int, q_len: int):
    """Caches in both layouts with the same content, scattered block tables, and q."""
    g = torch.Generator().manual_seed(0)
    nb = -(-ctx // BS)
    num_blocks = batch * nb + 1
    k_new = torch.randn(num_blocks, HKV, BS, D, generator=g).to(DTYPE)
    v_new = torch.randn(num_blocks, HKV, BS, D, generator=g).to(DTYPE)
    k_old = k_new.transpose(1, 2).contiguous()  # [num_blocks, BS, HKV, D]
    v_old = v_new.transpose(1, 2).contiguous()
    bt = torch.randperm(num_blocks, generator=g)[: batch * nb].view(batch, nb).to(torch.int32)
    q = torch.randn(batch * q_len, H, D, generator=g).to(DTYPE)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    ctx_lens = torch.full((batch,), ctx, dtype=torch.int32)
    pos = torch.arange(ctx)
    slots = bt.long()[:, pos // BS] * BS + pos % BS  # [batch, ctx]
    return k_new, v_new, k_old, v_old, bt, q, qsl, ctx_lens, slots


def bench_decode(C, batch: int, ctx: int) -> dict:
    k_new, v_new, k_old, v_old, bt, q, qsl, ctx_lens, slots = _setup(batch, ctx, 1)
    scale = D ** -0.5
    mask = torch.zeros(batch, 1, 1, ctx, dtype=DTYPE)
    flat_k, flat_v = k_old.view(-1, HKV, D), v_old.view(-1, HKV, D)

    def baseline():
        idx = slots.view(-1)
        kc = flat_k.index_select(0, idx).view(batch, ctx, HKV, D).transpose(1, 2)
        vc = flat_v.index_select(0, idx).view(batch, ctx, HKV, D).transpose(1, 2)
        return F.scaled_dot_product_attention(q.unsqueeze(2), kc, vc, attn_mask=mask,
                                              scale=scale, enable_gqa=True).squeeze(2)

    r = {"name": "decode", "shape": f"batch={batch} ctx={ctx} H={H} Hkv={HKV} D={D} bs={BS} bf16",
         "ms_gather_sdpa": _time_ms(baseline)}
    # the same engine path with an fp32 model (torch's bf16 SDPA on CPUs without native
    # bf16 is much slower than its fp32 one): the fairer yardstick for the kernel's speed
    q, mask, flat_k, flat_v = q.float(), mask.float(), flat_k.float(), flat_v.float()
    r["ms_gather_sdpa_fp32"] = _time_ms(baseline)
    q, mask, flat_k, flat_v = q.to(DTYPE), mask.to(DTYPE), flat_k.to(DTYPE), flat_v.to(DTYPE)
    if C is not None:
        out = torch.empty_like(q)
        r["ms_ours"] = _time_ms(lambda: C.paged_attention(out, q, k_new, v_new, bt, qsl, ctx_lens, scale))
        err = (out.float() - baseline().float()).abs().max().item()
        r["max_abs_diff"] = round(err, 5)
        kv_bytes = 2 * batch * ctx * HKV * D * 2
        r["gbps_ours"] = round(kv_bytes / r["ms_ours"] / 1e6, 1)
    else:
        r["ms_ours"] = None
    r["speedup"] = None if r["ms_ours"] is None else round(r["ms_gather_sdpa"] / r["ms_ours"], 2)
    r["speedup_vs_fp32"] = (None if r["ms_ours"] is None
                            else round(r["ms_gather_sdpa_fp32"] / r["ms_ours"], 2))
    return r


def bench_prefill(C, L: int) -> dict:
    k_new, v_new, k_old, v_old, bt, q, qsl, ctx_lens, slots = _setup(1, L, L)
    scale = D ** -0.5
    k = k_old.view(-1, HKV, D)[slots[0]]  # this step's fresh K/V, [L, HKV, D]
    v = v_old.view(-1, HKV, D)[slots[0]]

    def baseline():
        qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)

    r = {"name": "prefill", "shape": f"q_len=ctx={L} H={H} Hkv={HKV} D={D} bs={BS} bf16",
         "ms_sdpa_causal": _time_ms(baseline, min_reps=2)}
    if C is not None:
        out = torch.empty_like(q)
        r["ms_ours"] = _time_ms(lambda: C.paged_attention(out, q, k_new, v_new, bt, qsl, ctx_lens, scale),
                                min_reps=2)
        r["max_abs_diff"] = round((out.float() - baseline().float()).abs().max().item(), 5)
        r["gflops_ours"] = round(4 * H * D * L * (L + 1) / 2 / r["ms_ours"] / 1e6, 1)
    else:
        r["ms_ours"] = None
    r["speedup"] = None if r["ms_ours"] is None else round(r["ms_sdpa_causal"] / r["ms_ours"], 2)
    return r


def _step_case(batch: int, ctx: int, layers: int) -> tuple[list, list, tuple]:
    """A decode step's inputs: per layer K and V caches of ~32 MB (bf16, random), and
    ``(q, out, block_tables, query_start_loc, context_lens, scale)`` for ``batch`` rows of
    context ``ctx`` whose blocks are scattered in random order."""
    g = torch.Generator().manual_seed(1)
    nbk = 32 * 2**20 // (2 * HKV * BS * D * 2)  # blocks per layer: ~32 MB of K and V
    ks = [torch.randn(nbk, HKV, BS, D, generator=g).to(DTYPE) for _ in range(layers)]
    vs = [torch.randn(nbk, HKV, BS, D, generator=g).to(DTYPE) for _ in range(layers)]
    nb = -(-ctx // BS)
    bt = torch.randperm(nbk, generator=g)[: batch * nb].view(batch, nb).to(torch.int32)
    q = torch.randn(batch, H, D, generator=g).to(DTYPE)
    return ks, vs, (q, torch.empty_like(q), bt, torch.arange(0, batch + 1, dtype=torch.int32),
                    torch.full((batch,), ctx, dtype=torch.int32), D ** -0.5)


def bench_decode_step(C, batch: int = 64, ctx: int = 80, layers: int = 30) -> dict:
    """One decode step's attention as the server runs it: ``layers`` calls, each on its own
    layer's caches (blocks scattered over ~``layers`` x 32 MB, as in the server's 1 GiB
    KV), against the same calls on one cache reused (kept hot in the caches): ``ms_hot`` is
    the arithmetic alone, the difference the wait on KV reads (what the per-block K/V
    prefetch in ``csrc/attention.cpp`` shortens)."""
    ks, vs, args = _step_case(batch, ctx, layers)
    r = {"name": "decode step", "shape": f"{layers} layers x batch={batch} ctx={ctx} bs={BS} bf16"}
    if C is None:
        return {**r, "ms_ours": None, "ms_hot": None, "speedup": None}

    def step(hot: bool) -> None:
        for i in range(layers):
            j = 0 if hot else i
            C.paged_attention(args[1], args[0], ks[j], vs[j], *args[2:])

    r["ms_ours"] = _time_ms(lambda: step(False))
    r["ms_hot"] = _time_ms(lambda: step(True))
    r["speedup"] = round(r["ms_hot"] / r["ms_ours"], 2)
    return r


def bench_decode_step_int8(C, batch: int = 64, ctx: int = 80, layers: int = 30) -> dict:
    """:func:`bench_decode_step`'s step (each layer on its own caches) on int8 caches against
    the same step on bf16 caches holding the same values: what halving the K/V bytes gains."""
    ks, vs, args = _step_case(batch, ctx, layers)
    k8, v8 = [quantize_kv_rows(k) for k in ks], [quantize_kv_rows(v) for v in vs]
    r = {"name": "decode step int8 KV",
         "shape": f"{layers} layers x batch={batch} ctx={ctx} bs={BS} int8 rows vs bf16"}
    if C is None:
        return {**r, "ms_ours": None, "ms_bf16_cache": None, "speedup": None}

    def step(kc, vc) -> None:
        for i in range(layers):
            C.paged_attention(args[1], args[0], kc[i], vc[i], *args[2:])

    r["ms_ours"] = _time_ms(lambda: step(k8, v8))
    r["ms_bf16_cache"] = _time_ms(lambda: step(ks, vs))
    r["speedup"] = round(r["ms_bf16_cache"] / r["ms_ours"], 2)
    return r


def bench() -> list[dict]:
    """Time ours against the engine's torch path on the shapes in the module docstring.

    Returns:
        one dict per shape: ``name``, ``shape`` (str), ``ms_ours`` (None without the
        extension), the baseline's ``ms_gather_sdpa`` or ``ms_sdpa_causal`` (ms, best run),
        ``speedup`` (baseline / ours, >1: ours faster), for decode also
        ``ms_gather_sdpa_fp32`` / ``speedup_vs_fp32`` (the baseline on an fp32 cache and q,
        ours still bf16), ``max_abs_diff`` vs the baseline,
        ``gbps_ours`` (decode: K/V bytes read per second / 1e9) or ``gflops_ours``; the
        last row (:func:`bench_decode_step`): a step's 30 calls on their own caches vs
        ``ms_hot`` (one cache reused), ``speedup`` = hot / cold; then
        :func:`bench_decode_step_int8`: ``ms_bf16_cache``, ``speedup`` = bf16 / int8.
    """
    C = load_kernels()
    C = C if C is not None and hasattr(C, "paged_attention") else None
    rows = [bench_decode(C, b, c) for b, c in DECODES]
    rows.append(bench_prefill(C, PREFILL))
    rows.append(bench_decode_step(C))
    rows.append(bench_decode_step_int8(C))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"# threads={torch.get_num_threads()}  ms = best run; speedup = baseline / ours")
    for r in bench():
        base = r.get("ms_gather_sdpa", r.get("ms_sdpa_causal", r.get("ms_hot",
                                                                     r.get("ms_bf16_cache"))))
        extra = {k: v for k, v in r.items()
                 if k not in ("name", "shape", "ms_ours", "ms_gather_sdpa", "ms_sdpa_causal", "ms_hot",
                              "ms_bf16_cache", "speedup")}
        ours = "-" if r["ms_ours"] is None else f"{r['ms_ours']:.3f}"
        base_s = "-" if base is None else f"{base:.3f}"
        print(f"{r['name']:8s} {r['shape']:44s} ours {ours:>8s} ms  baseline {base_s:>8s} ms  "
              f"x{r['speedup']}  {extra}")


if __name__ == "__main__":
    main()
