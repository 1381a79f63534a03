"""csrc/cache_ops.cpp vs its pure-torch references (tokenserve/ops/layer_ref.py).

Tolerances: every op here is exact. RoPE is computed in fp32 with separate multiplies and
adds (no FMA), exactly what the fp32 torch reference does, then rounded once: the kernel
must equal the reference bit for bit (within 0 ulp, stricter than the 1 ulp allowed), on
the AVX2 path and on the portable one. The int8 cache's write (rows quantised with one fp32
scale each) is exact too: the same fp32 division, multiply and round-half-even as the
reference, so its bytes equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.layer_ref import (
    KV_SCALE_BYTES,
    copy_blocks_ref,
    dequantize_kv_rows,
    positions_and_slots_ref,
    quantize_kv_rows,
    rope_cos_sin,
    rotary_embedding_write_kv_ref,
)

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None, reason="tokenserve._C not built")

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(params=["vector", "portable"])
def path(request):
    """Run a test on the machine's best path, then again with the portable one forced."""
    old = C._cache_ops_force_portable(request.param == "portable")
    yield request.param
    C._cache_ops_force_portable(old)


def _inv_freq(D: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)


def _rope_case(T, H, Hkv, D, bs, dtype, seed=0, max_pos=4096, kv="model", rotary_dim=None):
    """(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping); ``rotary_dim`` (default
    D): the table's width (partial rotary when narrower than the head)."""
    g = torch.Generator().manual_seed(seed)
    nb = max(4, (T + bs - 1) // bs * 2 + 3)
    qkv = (torch.randn(T, (H + 2 * Hkv) * D, generator=g) * 3).to(dtype)
    positions = torch.randint(0, max_pos, (T,), generator=g)
    perm = torch.randperm(nb * bs, generator=g)[:T]  # distinct random slots
    slots = perm.clone()
    if T >= 3:
        slots[1] = -1  # padding token: not written
    k_cache = torch.randn(nb, Hkv, bs, D, generator=g).to(dtype)
    v_cache = torch.randn(nb, Hkv, bs, D, generator=g).to(dtype)
    if kv == "int8":
        k_cache, v_cache = quantize_kv_rows(k_cache), quantize_kv_rows(v_cache)
    cs = rope_cos_sin(_inv_freq(rotary_dim or D), max_pos)
    return qkv, positions, cs, k_cache, v_cache, slots


def _kernel_equals_reference(args, H, Hkv) -> list[torch.Tensor]:
    """The kernel and the reference on copies of ``args``: every tensor bit-equal after;
    returns the kernel's."""
    mine = [a.clone() for a in args]
    ref = [a.clone() for a in args]
    C.rotary_embedding_write_kv(*mine, H, Hkv)
    rotary_embedding_write_kv_ref(*ref, H, Hkv)
    for got, want in zip(mine, ref):
        assert torch.equal(got, want)
    return mine


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [0, 1, 3, 17, 300])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 24), (2, 1, 40)])
@pytest.mark.parametrize("bs", [5, 16, 128])
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_rotary_embedding_write_kv_matches_reference(path, dtype, T, H, Hkv, D, bs, kv):
    args = _rope_case(T, H, Hkv, D, bs, dtype, seed=T * 7 + bs, kv=kv)
    mine = _kernel_equals_reference(args, H, Hkv)
    if T:  # the op did something: q/k changed, v untouched, cache rows written
        assert not torch.equal(mine[0][:, : (H + Hkv) * D], args[0][:, : (H + Hkv) * D])
        assert torch.equal(mine[0][:, (H + Hkv) * D:], args[0][:, (H + Hkv) * D:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,R", [(16, 12), (64, 48), (96, 32), (128, 96)])
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_partial_rotary_matches_reference(path, dtype, D, R, kv):
    """A table narrower than the head (Phi-4-mini's ``partial_rotary_factor``): the first
    R dims of each q and k head rotate, the rest pass through; bits = the reference's."""
    H, Hkv, T = 4, 2, 19
    args = _rope_case(T, H, Hkv, D, 16, dtype, kv=kv, rotary_dim=R)
    qkv, positions, _, k_cache, v_cache, slots = args
    mine = _kernel_equals_reference(args, H, Hkv)
    heads = mine[0][:, : (H + Hkv) * D].view(T, H + Hkv, D)
    before = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    assert torch.equal(heads[..., R:], before[..., R:])  # the rest passes through
    assert not torch.equal(heads[..., :R], before[..., :R])
    with pytest.raises(RuntimeError, match="R even"):  # odd or wider than the head
        C.rotary_embedding_write_kv(qkv.clone(), positions, rope_cos_sin(_inv_freq(D + 2), 4096),
                                    k_cache.clone(), v_cache.clone(), slots, H, Hkv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_cache_rows(path, dtype):
    """The int8 write keeps each row within half a step (scale / 2) of the model-dtype
    values, its largest magnitude exactly (as +-127), a zero row as zeros with scale 0,
    and rows with a huge spread (only the largest values survive) without overflow."""
    T, H, Hkv, D, bs = 9, 9, 3, 64, 16
    qkv, pos, cs, kc, vc, slots = _rope_case(T, H, Hkv, D, bs, dtype, seed=5, kv="int8")
    qkv[4, (H + Hkv) * D:] = 0  # token 4's V rows: all zero
    qkv[6, (H + Hkv) * D:(H + Hkv) * D + 1] = 3e4  # token 6's first V row: one huge value
    C.rotary_embedding_write_kv(qkv, pos, cs, kc, vc, slots, H, Hkv)
    bs_ = kc.shape[2]
    for t in (0, 4, 6):
        blk, row = int(slots[t]) // bs_, int(slots[t]) % bs_
        k = qkv[t, H * D:(H + Hkv) * D].view(Hkv, D).float()
        v = qkv[t, (H + Hkv) * D:].view(Hkv, D).float()
        for rows, x in ((kc[blk, :, row], k), (vc[blk, :, row], v)):
            scale = rows[:, -KV_SCALE_BYTES:].flatten().view(torch.float32).view(-1, 1)
            err = (dequantize_kv_rows(rows) - x).abs()
            assert torch.all(err <= scale * 0.5 * (1 + 1e-5))  # + the fp32 products
            assert torch.all(rows[:, :-KV_SCALE_BYTES].abs().amax(-1) == (x.abs().amax(-1) > 0) * 127)
    blk, row = int(slots[4]) // bs_, int(slots[4]) % bs_
    assert torch.all(vc[blk, :, row] == 0)


def test_rotary_rejects_int8_cache_of_wrong_width():
    qkv, pos, cs, kc, vc, slots = _rope_case(3, 9, 3, 64, 16, torch.bfloat16, kv="int8")
    with pytest.raises(RuntimeError, match="int8"):
        C.rotary_embedding_write_kv(qkv, pos, cs, kc[..., :64].contiguous(),
                                    vc[..., :64].contiguous(), slots, 9, 3)
    with pytest.raises(RuntimeError, match="dtypes differ|int8"):
        C.rotary_embedding_write_kv(qkv, pos, cs, kc, torch.zeros(vc.shape, dtype=torch.bfloat16),
                                    slots, 9, 3)


def test_rotary_matches_fp32_reference_within_one_bf16_ulp():
    """bf16 kernel output = the fp32 math rounded once (at most 1/2 ulp from fp32 RoPE)."""
    qkv, pos, cs, kc, vc, slots = _rope_case(17, 9, 3, 64, 16, torch.bfloat16, seed=3)
    f32 = [qkv.float(), pos, cs, kc.float(), vc.float(), slots]
    rotary_embedding_write_kv_ref(*f32, 9, 3)
    C.rotary_embedding_write_kv(qkv, pos, cs, kc, vc, slots, 9, 3)
    assert torch.equal(qkv, f32[0].to(torch.bfloat16))


def test_rotary_position_zero_is_identity_and_slot_skip():
    qkv, pos, cs, kc, vc, slots = _rope_case(3, 4, 4, 24, 5, torch.float32, seed=1)
    pos.zero_()
    before, kc0 = qkv.clone(), kc.clone()
    slots[:] = torch.tensor([-1, 7, -5])
    C.rotary_embedding_write_kv(qkv, pos, cs, kc, vc, slots, 4, 4)
    assert torch.equal(qkv, before)  # cos 1, sin 0
    changed = (kc != kc0).any(dim=(1, 3))  # [blocks, rows]
    assert changed.nonzero().tolist() == [[1, 2]]  # slot 7 = block 1, row 2 only
    assert torch.equal(kc[1, :, 2], qkv[1, 4 * 24: 8 * 24].view(4, 24))
    assert torch.equal(vc[1, :, 2], qkv[1, 8 * 24:].view(4, 24))


def test_rotary_strided_rows():
    """qkv may be a row-strided view (stride(1) == 1) of a wider buffer."""
    qkv, pos, cs, kc, vc, slots = _rope_case(17, 9, 3, 64, 16, torch.bfloat16, seed=5)
    wide = torch.zeros(17, qkv.shape[1] + 32, dtype=qkv.dtype)
    wide[:, : qkv.shape[1]] = qkv
    view = wide[:, : qkv.shape[1]]
    ref = [qkv.clone(), pos, cs, kc.clone(), vc.clone(), slots]
    C.rotary_embedding_write_kv(view, pos, cs, kc, vc, slots, 9, 3)
    rotary_embedding_write_kv_ref(*ref, 9, 3)
    assert torch.equal(view, ref[0]) and torch.equal(kc, ref[3]) and torch.equal(vc, ref[4])
    assert not wide[:, qkv.shape[1]:].any()


def test_rotary_row_invariance():
    """A token's result is bit-identical alone or inside a batch of 300."""
    qkv, pos, cs, kc, vc, slots = _rope_case(300, 9, 3, 64, 128, torch.bfloat16, seed=9)
    batch = qkv.clone()
    C.rotary_embedding_write_kv(batch, pos, cs, kc.clone(), vc.clone(), slots, 9, 3)
    for t in (0, 1, 150, 299):
        one = qkv[t: t + 1].clone()
        C.rotary_embedding_write_kv(one, pos[t: t + 1], cs, kc.clone(), vc.clone(),
                                    slots[t: t + 1], 9, 3)
        assert torch.equal(one[0], batch[t])


def test_rotary_rejects_bad_arguments():
    qkv, pos, cs, kc, vc, slots = _rope_case(3, 4, 4, 24, 5, torch.float32)
    with pytest.raises(RuntimeError, match="position"):
        C.rotary_embedding_write_kv(qkv, torch.tensor([0, 1, 4096]), cs, kc, vc, slots, 4, 4)
    with pytest.raises(RuntimeError, match="slot"):
        bad = slots.clone()
        bad[0] = kc.shape[0] * kc.shape[2]
        C.rotary_embedding_write_kv(qkv, pos, cs, kc, vc, bad, 4, 4)
    with pytest.raises(RuntimeError, match="multiple"):
        C.rotary_embedding_write_kv(qkv, pos, cs, kc, vc, slots, 5, 4)
    with pytest.raises(RuntimeError, match="k_cache"):
        C.rotary_embedding_write_kv(qkv, pos, cs, kc.bfloat16(), vc, slots, 4, 4)
    with pytest.raises(RuntimeError, match="k_cache"):
        C.rotary_embedding_write_kv(qkv, pos, cs, kc.transpose(1, 2), vc, slots, 4, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [5, 16, 128])
@pytest.mark.parametrize("pairs", [[], [(0, 3)], [(1, 6), (2, 0), (5, 7)]])
def test_copy_blocks_matches_reference(dtype, bs, pairs):
    g = torch.Generator().manual_seed(bs)
    L, nb, Hkv, D = 3, 8, 3, 24
    ks = [torch.randn(nb, Hkv, bs, D, generator=g).to(dtype) for _ in range(L)]
    vs = [torch.randn(nb, Hkv, bs, D, generator=g).to(dtype) for _ in range(L)]
    bm = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
    rk, rv = [k.clone() for k in ks], [v.clone() for v in vs]
    C.copy_blocks(ks, vs, bm)
    copy_blocks_ref(rk, rv, bm)
    for a, b in zip(ks + vs, rk + rv):
        assert torch.equal(a, b)
    for s, d in pairs:
        assert torch.equal(ks[2][d], ks[2][s]) and torch.equal(vs[0][d], vs[0][s])


def test_copy_blocks_rejects_bad_mappings():
    k = [torch.zeros(4, 1, 2, 2)]
    v = [torch.zeros(4, 1, 2, 2)]
    for bad in ([(0, 4)], [(-1, 0)], [(0, 1), (2, 1)], [(0, 1), (1, 2)]):
        with pytest.raises(RuntimeError):
            C.copy_blocks(k, v, torch.tensor(bad))


def _tables(S, max_blocks, nb, g):
    """Random non-consecutive block tables (distinct blocks across the batch), -1 padded."""
    perm = torch.randperm(nb, generator=g)[: S * max_blocks].view(S, max_blocks)
    return perm.to(torch.int32)


@pytest.mark.parametrize("S", [0, 1, 3, 17])
@pytest.mark.parametrize("bs", [5, 16, 128])
def test_positions_and_slots_matches_reference(S, bs):
    g = torch.Generator().manual_seed(S * 31 + bs)
    max_blocks = 6
    bt = _tables(S, max_blocks, S * max_blocks + 5, g)
    ctx = torch.randint(1, max_blocks * bs + 1, (S,), generator=g)
    q = torch.minimum(ctx, torch.randint(0, 40, (S,), generator=g))
    if S:
        q[0] = 1  # a decode token
        q[-1] = ctx[-1]  # a full prefill
    qsl = torch.zeros(S + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    ctx = ctx.to(torch.int32)
    # blocks past the context are absent (-1): the kernel must not need them
    used = (ctx.long() + bs - 1) // bs
    for s in range(S):
        bt[s, int(used[s]):] = -1
    pos, slots = C.positions_and_slots(bt, qsl, ctx, bs)
    rpos, rslots = positions_and_slots_ref(bt, qsl, ctx, bs)
    assert pos.dtype == slots.dtype == torch.int64
    assert torch.equal(pos, rpos) and torch.equal(slots, rslots)
    assert pos.shape[0] == int(qsl[-1])


def test_positions_and_slots_layout_example():
    # seq 0: decode at position 6 (ctx 7), bs 4 -> block bt[0][1] = 9 row 2 -> slot 38
    # seq 1: prefill chunk of 3 after 2 cached: positions 2, 3, 4 -> blocks 5,5,2
    bt = torch.tensor([[4, 9, -1], [5, 2, -1]], dtype=torch.int32)
    pos, slots = C.positions_and_slots(bt, torch.tensor([0, 1, 4], dtype=torch.int32),
                                       torch.tensor([7, 5], dtype=torch.int32), 4)
    assert pos.tolist() == [6, 2, 3, 4]
    assert slots.tolist() == [38, 22, 23, 8]


def test_positions_and_slots_rejects_missing_blocks():
    bt = torch.tensor([[4, -1]], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="missing"):
        C.positions_and_slots(bt, qsl, torch.tensor([5], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="blocks"):
        C.positions_and_slots(bt, qsl, torch.tensor([9], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match="q_len"):
        C.positions_and_slots(bt, torch.tensor([0, 3], dtype=torch.int32),
                              torch.tensor([2], dtype=torch.int32), 4)
    with pytest.raises(ValueError):
        positions_and_slots_ref(bt, qsl, torch.tensor([5], dtype=torch.int32), 4)
