"""Tensor parallelism's split of a model: which heads, MLP columns and vocabulary rows a
rank holds, and the checkpoint cut to them (pure; no communication here).

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", §3), as vLLM and SGLang serve it::

    q/k/v      column-parallel: rank r holds its heads' rows       [heads_r * D, hidden]
    o          row-parallel:    the same heads' columns             [hidden, q_heads_r * D]
               -> partial sums, one all-reduce
    gate/up    column-parallel: MLP rows [i0, i1)                   [i1 - i0, hidden]
    down       row-parallel:    MLP columns [i0, i1)                [hidden, i1 - i0]
               -> partial sums, one all-reduce
    embedding  vocab-parallel:  rows [v0, v1); a token outside them looks up zeros,
               one all-reduce (exact: one rank contributes each row)
    lm_head    vocab-parallel:  rows [v0, v1); fp32 logits gathered along the vocabulary

Heads go by KV group (a KV head and the query heads that read it) so a rank's attention is
the kernels' ordinary GQA: with fewer KV heads than ranks, each KV head is replicated on
``ranks / kv_heads`` ranks that split its query heads. Splits need not be even
(SmolLM2-135M's 3 KV heads over 2 ranks: 2 groups and 1). Row-parallel columns of a
GGUF-block weight are cut on its block boundaries; where a cut falls inside a block (a
K-quant ``o`` whose rank holds 6 heads of 64: 384 columns, not a multiple of 256) that
rank's part is dequantised to the model dtype, and the load log says so.

What is not split is refused in one line: mixture-of-experts layers, OLMo 2's q/k norm over
the whole projection (it mixes heads), fused q|k|v or gate|up checkpoint tensors (Phi-3).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import torch

from tokenserve.models.config import ModelConfig
from tokenserve.ops.collectives import Collectives
from tokenserve.ops.quant import dequantize_ref
from tokenserve.ops.quant_blocks import BLOCK_BYTES, BLOCK_ELEMS, QuantWeight
from tokenserve.ops.quant_int8 import Int8Weight

log = logging.getLogger("tokenserve.models")

#: MLP columns are cut on the first of these that divides the width (a K-quant super-block,
#: a Q8_0 / Q4_0 block), so the down projection's blocks are not cut
MLP_UNITS = (256, 32)

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
#: layer tensors kept whole on every rank (norms, and per-head q/k norms)
_REPLICATED = {"input_layernorm.weight", "post_attention_layernorm.weight",
               "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight"}


@dataclass(frozen=True)
class TpShard:
    """What rank ``rank`` of ``world`` holds; every range is ``(lo, hi)``, half-open.

    Attributes:
        q_heads: global query heads.
        kv_heads: global KV heads (replicated ones appear on several ranks).
        mlp: global MLP columns (intermediate features).
        vocab: global vocabulary rows of the embedding and lm_head.
        head_dim: D.
    """

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]
    vocab: tuple[int, int]
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def _even(n: int, rank: int, world: int, unit: int = 1) -> tuple[int, int]:
    """Rank ``rank``'s part of ``n`` items split ``world`` ways in multiples of ``unit``
    (the last units go to the last ranks)."""
    units = n // unit
    return rank * units // world * unit, ((rank + 1) * units // world * unit
                                          if rank + 1 < world else n)


def plan_shard(cfg: ModelConfig, rank: int, world: int) -> TpShard:
    """Rank ``rank``'s share of ``cfg`` split ``world`` ways (see the module doc).

    Raises:
        ValueError: the model cannot be split this way (one line naming why): more ranks
            than query heads, KV heads that do not divide among the ranks, a block the split
            does not support.
    """
    assert 0 <= rank < world
    arch = cfg.decoder_arch
    if arch.moe is not None or any(layer.moe for layer in arch.layers):
        raise ValueError("tensor parallelism does not split mixture-of-experts layers yet "
                         f"({cfg.model_type}); serve it with --tensor-parallel-size 1")
    if arch.qk_norm == "full":
        raise ValueError(f"tensor parallelism cannot split {cfg.model_type}'s q/k norm over "
                         "the whole projection (it mixes heads); serve it with "
                         "--tensor-parallel-size 1")
    H, Hkv = cfg.num_heads, cfg.num_kv_heads
    group = H // Hkv
    if world <= Hkv:
        kv = _even(Hkv, rank, world)
        q = (kv[0] * group, kv[1] * group)
    elif world % Hkv == 0 and group % (world // Hkv) == 0:
        per_kv = world // Hkv
        k = rank // per_kv
        q_per = group // per_kv
        q0 = k * group + (rank % per_kv) * q_per
        kv, q = (k, k + 1), (q0, q0 + q_per)
    else:
        raise ValueError(f"tensor parallelism: {H} query heads in {Hkv} KV groups do not "
                         f"split over {world} ranks (need ranks <= KV heads, or a multiple "
                         "of them that divides each group's query heads)")
    inter = cfg.intermediate_size
    # cut on K-quant super-blocks, else on Q8_0 / Q4_0 blocks, where the width allows
    unit = next((u for u in MLP_UNITS if inter % u == 0 and inter // u >= world), 1)
    return TpShard(rank, world, q, kv, _even(inter, rank, world, unit),
                   _even(cfg.vocab_size, rank, world), cfg.head_dim)


def shard_config(cfg: ModelConfig, shard: TpShard) -> ModelConfig:
    """The rank's own config: its head counts, MLP width and vocabulary rows (the layer
    arch, windows and RoPE stay as they are)."""
    return replace(cfg, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
                   intermediate_size=shard.mlp[1] - shard.mlp[0],
                   vocab_size=shard.vocab[1] - shard.vocab[0])


def _rows(t, lo: int, hi: int):
    """Output rows [lo, hi) of a weight or bias, as its own copy."""
    if isinstance(t, Int8Weight):
        assert t.layout == "rows"
        return Int8Weight(t.data[lo:hi].clone(), "int8", (hi - lo, t.shape[1]),
                          scale=t.scale[lo:hi].clone(),
                          table=None if t.table is None else t.table[lo:hi].clone())
    if isinstance(t, QuantWeight):
        assert t.layout == "rows"
        return QuantWeight(t.data[lo:hi].clone(), t.qtype, (hi - lo, t.shape[1]))
    return t[lo:hi].clone()


def _cols(t, lo: int, hi: int, dtype: torch.dtype, name: str):
    """Input columns [lo, hi) of a weight, as its own copy; GGUF blocks are cut on block
    boundaries, or dequantised to ``dtype`` when [lo, hi) is not on them."""
    if isinstance(t, Int8Weight):
        assert t.layout == "rows"
        return Int8Weight(t.data[:, lo:hi].clone(), "int8", (t.shape[0], hi - lo),
                          scale=t.scale.clone())
    if isinstance(t, QuantWeight):
        assert t.layout == "rows"
        qk, bb = BLOCK_ELEMS[t.qtype], BLOCK_BYTES[t.qtype]
        if lo % qk == 0 and hi % qk == 0:
            n = t.shape[0]
            blocks = t.data.view(n, t.shape[1] // qk, bb)[:, lo // qk:hi // qk]
            return QuantWeight(blocks.reshape(n, -1).clone(), t.qtype, (n, hi - lo))
        log.info("tensor parallelism: %s columns [%d, %d) cut %s blocks of %d: this rank's "
                 "part runs at %s", name, lo, hi, t.qtype, qk, str(dtype).removeprefix("torch."))
        return dequantize_ref(t)[:, lo:hi].to(dtype).contiguous()
    return t[:, lo:hi].clone()


def shard_state_dict(sd: dict, cfg: ModelConfig, shard: TpShard,
                     dtype: torch.dtype) -> dict:
    """The HF-named checkpoint ``sd`` cut to ``shard`` (new dict; ``sd`` is emptied as it
    is read, so the whole tensors can be freed). Row-parallel biases (``o``, ``down``) stay
    on rank 0 and are zeros elsewhere (the all-reduce adds them once).

    Raises:
        ValueError: a layer tensor this split does not know (a fused ``qkv_proj`` ...).
    """
    D = shard.head_dim
    q0, q1 = shard.q_heads[0] * D, shard.q_heads[1] * D
    k0, k1 = shard.kv_heads[0] * D, shard.kv_heads[1] * D
    i0, i1 = shard.mlp
    v0, v1 = shard.vocab
    out: dict = {}
    for name in list(sd):
        t = sd.pop(name)
        m = _LAYER.fullmatch(name)
        if m is None:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                out[name] = _rows(t, v0, v1)
            else:  # the final norm
                out[name] = t
            continue
        role = m.group(2)
        if role in _REPLICATED:
            out[name] = t
        elif role in ("self_attn.q_proj.weight", "self_attn.q_proj.bias"):
            out[name] = _rows(t, q0, q1)
        elif role in ("self_attn.k_proj.weight", "self_attn.k_proj.bias",
                      "self_attn.v_proj.weight", "self_attn.v_proj.bias"):
            out[name] = _rows(t, k0, k1)
        elif role == "self_attn.o_proj.weight":
            out[name] = _cols(t, q0, q1, dtype, name)
        elif role in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
            out[name] = _rows(t, i0, i1)
        elif role == "mlp.down_proj.weight":
            out[name] = _cols(t, i0, i1, dtype, name)
        elif role in ("self_attn.o_proj.bias", "mlp.down_proj.bias"):
            out[name] = t if shard.rank == 0 else torch.zeros_like(t)
        else:
            raise ValueError(f"tensor parallelism does not know how to split {name} "
                             f"({cfg.model_type}); serve it with --tensor-parallel-size 1")
    return out


@dataclass(frozen=True)
class TpContext:
    """What a :class:`~tokenserve.models.decoder.CausalLM` needs to run one rank's part:
    its share and the group's collectives."""

    shard: TpShard
    comm: Collectives
