"""The C++ ``paged_attention`` kernel (csrc/attention.cpp) against
``tokenserve.ops.reference.paged_attention_ref``, plus its batch invariance.

Tolerances: fp32 output within 2e-5 absolute (inputs ~N(0, 1), outputs |o| < 4) and
1e-5 relative; bf16 output against the fp32 reference computed on the same bf16 inputs
within 1 bf16 ulp of the output scale (2**(floor(log2 max|ref|) - 7)): the kernel rounds
once, so its error is half an ulp of the output plus fp32 noise.
Invariance tests use ``torch.equal`` (bit-exact). The int8 cache (rows of
``quantize_kv_rows``) is checked against the reference on the same int8 rows, dequantised:
the kernel applies the scales after the dot products, so the same tolerances hold.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.layer_ref import KV_SCALE_BYTES, quantize_kv_rows
from tokenserve.ops.reference import paged_attention_ref

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C not built")

PATHS = ["paged_attention", "paged_attention_portable"]


class Case:
    """A cache holding ``len(ctx_lens)`` sequences' contexts in shuffled blocks."""

    def __init__(self, ctx_lens, q_lens, H=9, Hkv=3, D=64, bs=16, dtype=torch.float32,
                 seed=0, strided_q=False, kv="model", window=0, softcap=0.0):
        g = torch.Generator().manual_seed(seed)
        self.window, self.softcap = window, softcap  # sliding window, logit soft-cap
        self.H, self.Hkv, self.D, self.bs, self.dtype = H, Hkv, D, bs, dtype
        nblk = [math.ceil(c / bs) for c in ctx_lens]
        num_blocks = sum(nblk) + 2
        self.k_cache = torch.randn(num_blocks, Hkv, bs, D, generator=g).to(dtype)
        self.v_cache = torch.randn(num_blocks, Hkv, bs, D, generator=g).to(dtype)
        if kv == "int8":  # rows of the model dtype's values, quantised as the write does
            self.k_cache = quantize_kv_rows(self.k_cache)
            self.v_cache = quantize_kv_rows(self.v_cache)
        perm = torch.randperm(num_blocks, generator=g)  # non-consecutive, random order
        self.block_tables = torch.full((len(ctx_lens), max(nblk, default=0) + 1), -1,
                                       dtype=torch.int32)
        i = 0
        for s, n in enumerate(nblk):
            self.block_tables[s, :n] = perm[i:i + n].to(torch.int32)
            i += n
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        self.query_start_loc = torch.tensor([0] + [sum(q_lens[:i + 1]) for i in range(len(q_lens))],
                                            dtype=torch.int32)
        T = sum(q_lens)
        if strided_q:  # q as a slice of a fused qkv projection output
            qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
            self.q = qkv[:, : H * D].view(T, H, D)
            assert not self.q.is_contiguous() or T <= 1
        else:
            self.q = torch.randn(T, H, D, generator=g).to(dtype)
        self.scale = D ** -0.5

    def run(self, path="paged_attention", q=None, block_tables=None, qsl=None, ctx=None):
        q = self.q if q is None else q
        out = torch.full(q.shape, float("nan"), dtype=q.dtype)
        getattr(C, path)(out, q, self.k_cache, self.v_cache,
                         self.block_tables if block_tables is None else block_tables,
                         self.query_start_loc if qsl is None else qsl,
                         self.context_lens if ctx is None else ctx, self.scale,
                         self.window, self.softcap)
        return out

    def ref(self):
        int8 = self.k_cache.dtype == torch.int8
        return paged_attention_ref(self.q.float(), self.k_cache if int8 else self.k_cache.float(),
                                   self.v_cache if int8 else self.v_cache.float(),
                                   self.block_tables, self.query_start_loc, self.context_lens,
                                   self.scale, self.window, self.softcap)


def assert_matches_ref(case, out, fp32_atol=2e-5):
    ref = case.ref()
    assert out.dtype == case.dtype and out.shape == ref.shape
    if ref.numel() == 0:
        return
    if case.dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=fp32_atol, rtol=1e-5)
    else:
        ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
        err = (out.float() - ref).abs().max().item()
        assert err <= ulp, f"bf16 error {err} > 1 ulp {ulp} at the output scale"


# (ctx_lens, q_lens) as functions of the block size: decode, whole prefill, chunk after a
# cached prefix, mixed; contexts 1, bs, bs+1 and many blocks.
def batches(bs):
    return {
        "empty": ([], []),
        "decode_ctx1": ([1], [1]),
        "decode_bs": ([bs], [1]),
        "decode_bs1": ([bs + 1], [1]),
        "decode_long": ([9 * bs + 3], [1]),
        "prefill_bs1": ([bs + 1], [bs + 1]),
        "prefill_long": ([3 * bs + 2], [3 * bs + 2]),
        "chunk_after_prefix": ([4 * bs + 1], [bs + 2]),
        "mixed3": ([bs, 2 * bs + 3, 37], [1, 2 * bs + 3, 11]),
        "mixed17": ([1 + (i * 29) % (5 * bs) for i in range(17)],
                    [1 if i % 3 else min(1 + (i * 7) % 20, 1 + (i * 29) % (5 * bs))
                     for i in range(17)]),
        "zero_len_rows": ([5, 9, bs + 4], [0, 3, 0]),
    }


@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("bs", [5, 16, 128])
@pytest.mark.parametrize("D", [64, 36])
def test_matches_reference(dtype, heads, bs, D, kv):
    for name, (ctx, ql) in batches(bs).items():
        case = Case(ctx, ql, H=heads[0], Hkv=heads[1], D=D, bs=bs, dtype=dtype,
                    strided_q=name.startswith("mixed"), kv=kv)
        for path in PATHS:
            if path.endswith("portable") and bs == 128 and name == "prefill_long":
                continue  # slow scalar path; covered at block sizes 5 and 16
            out = case.run(path)
            try:
                assert_matches_ref(case, out)
            except AssertionError as e:
                raise AssertionError(f"{name} {path}: {e}") from None


@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [24, 8, 3])
def test_other_head_dims(dtype, D, kv):
    case = Case([37, 1, 21], [5, 1, 21], H=4, Hkv=2, D=D, bs=16, dtype=dtype, strided_q=True,
                kv=kv)
    for path in PATHS:
        assert_matches_ref(case, case.run(path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_scores(dtype):
    """Large logits: the running max jumps between blocks and most exp() underflow to 0.
    Logits reach ~50, so fp32 rounding of a logit (~50 * 2**-24 per op) moves exp() by a
    few 1e-6 relative: the fp32 reference itself is 2.5e-5 off a float64 one here, hence
    atol 1e-4."""
    case = Case([200, 77, 1], [1, 77, 1], bs=16, dtype=dtype, seed=3)
    case.q = (case.q.float() * 40).to(dtype)
    for path in PATHS:
        assert_matches_ref(case, case.run(path), fp32_atol=1e-4)


def test_rows_of_no_sequence_untouched_and_empty_step():
    case = Case([10, 12], [2, 3])
    q = torch.randn(7, 9, 64)  # rows 5, 6 belong to no sequence
    out = torch.full(q.shape, 7.0)
    C.paged_attention(out, q, case.k_cache, case.v_cache, case.block_tables,
                      case.query_start_loc, case.context_lens, case.scale)
    assert torch.all(out[5:] == 7.0) and not torch.any(out[:5] == 7.0)
    empty = Case([], [])
    assert empty.run().shape == (0, 9, 64)


# ---------------------------------------------------------------- batch invariance

def _invariance(dtype, H, Hkv, D, bs, path, L=70, prefix=23, kv="model", window=0, softcap=0.0):
    """Rows of one sequence of length L computed as: a whole prefill, a chunk after a
    cached prefix (several chunk splits, so rows sit at other tile positions), decodes
    (one per position, all in one call), and inside a mixed batch with other sequences."""
    case = Case([L], [L], H=H, Hkv=Hkv, D=D, bs=bs, dtype=dtype, seed=1, kv=kv, window=window,
                softcap=softcap)
    bt, q = case.block_tables, case.q
    full = case.run(path)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)

    # decode: sequence p has q_len 1 and context p + 1, same block table
    dec = case.run(path, block_tables=bt.repeat(L, 1),
                   qsl=torch.arange(L + 1, dtype=torch.int32), ctx=i32(list(range(1, L + 1))))
    assert torch.equal(dec, full), "decode rows differ from prefill rows"

    # chunked prefill: [0, prefix) as one step, then the rest after the cached prefix;
    # and three uneven chunks
    for cuts in ([prefix], [1, 17, 50], [L - 1]):
        edges = [0] + cuts + [L]
        for a, b in zip(edges, edges[1:]):
            out = case.run(path, q=q[a:b], qsl=i32([0, b - a]), ctx=i32([b]))
            assert torch.equal(out, full[a:b]), f"chunk [{a}, {b}) differs"

    # inside a mixed step: decodes of other sequences first, then the chunk, then another
    # prefill; the other sequences use the same cache blocks in another order
    nblk = math.ceil(L / bs)
    other = bt.clone()
    other[:, :nblk] = bt[:, :nblk].flip(1)
    a, b = prefix, L
    qm = torch.cat([q[5:8], q[a:b], q[:40]])
    bts = torch.cat([bt, bt, bt, bt, other])
    out = case.run(path, q=qm, block_tables=bts, qsl=i32([0, 1, 2, 3, 3 + b - a, 3 + b - a + 40]),
                   ctx=i32([6, 7, 8, b, 40]))
    assert torch.equal(out[:3], full[5:8])
    assert torch.equal(out[3:3 + b - a], full[a:b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,D,bs", [((9, 3), 64, 16), ((9, 3), 64, 128), ((4, 4), 36, 5),
                                        ((8, 2), 24, 16)])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_batch_invariance(dtype, heads, D, bs, path, kv):
    _invariance(dtype, heads[0], heads[1], D, bs, path, kv=kv)


@pytest.mark.parametrize("kv", ["model", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_thread_count_invariance(dtype, kv):
    case = Case([300, 1, 130, 77], [300, 1, 1, 40], bs=16, dtype=dtype, strided_q=True, kv=kv)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(case.run())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ---------------------------------------------------------------- argument errors

def test_bad_arguments_raise():
    case = Case([10], [2])
    ok = dict(q=case.q, block_tables=case.block_tables, qsl=case.query_start_loc,
              ctx=case.context_lens)

    def call(**kw):
        a = {**ok, **kw}
        out = torch.empty(a["q"].shape, dtype=a["q"].dtype)
        C.paged_attention(out, a["q"], case.k_cache, case.v_cache, a["block_tables"], a["qsl"],
                          a["ctx"], case.scale)

    with pytest.raises(RuntimeError, match="q's dtype"):
        call(q=case.q.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="int32"):
        call(block_tables=case.block_tables.long())
    with pytest.raises(RuntimeError, match="context_lens"):
        call(ctx=torch.tensor([1], dtype=torch.int32))  # ctx < q_len
    with pytest.raises(RuntimeError, match="context_lens"):
        call(ctx=torch.tensor([10_000], dtype=torch.int32))  # beyond the block table
    with pytest.raises(RuntimeError, match="out of range"):
        call(block_tables=torch.full_like(case.block_tables, 999))
    with pytest.raises(RuntimeError, match="query_start_loc"):
        call(qsl=torch.tensor([0, 5], dtype=torch.int32))  # beyond T
    with pytest.raises(RuntimeError, match="stride"):
        call(q=case.q.transpose(1, 2).contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="multiple"):
        C.paged_attention(torch.empty(2, 4, 64), torch.randn(2, 4, 64), case.k_cache,
                          case.v_cache, case.block_tables, case.query_start_loc,
                          case.context_lens, case.scale)


def test_int8_cache_arguments_raise():
    """An int8 cache needs head_dim + 4 bytes a row and an int8 V cache beside it."""
    case = Case([10], [2], kv="int8")
    out = torch.empty(case.q.shape, dtype=case.q.dtype)
    args = (case.block_tables, case.query_start_loc, case.context_lens, case.scale)
    with pytest.raises(RuntimeError, match="head_dim"):
        C.paged_attention(out, case.q, case.k_cache[..., :-KV_SCALE_BYTES].contiguous(),
                          case.v_cache[..., :-KV_SCALE_BYTES].contiguous(), *args)
    with pytest.raises(RuntimeError, match="int8"):
        C.paged_attention(out, case.q, case.k_cache, torch.zeros(case.v_cache.shape), *args)
