"""The decoder every family runs: shared blocks over a paged KV cache.

A family (``tokenserve/models/families/``) turns its config into a
:class:`~tokenserve.models.config.DecoderArch` (which blocks a layer has) and its checkpoint
into :class:`~tokenserve.models.families.base.LayerWeights`; :class:`CausalLM` fuses the
projections at load (q|k|v into one GEMM, gate|up into one: on CPU fewer, larger GEMMs are
markedly faster) and runs the layers. Numerics follow transformers' modeling files (RMSNorm
in fp32, rotate-half RoPE, softmax in fp32), so fp32 logits match them tightly.

A plain Llama layer (:attr:`DecoderArch.llama_layers`; Qwen3's per-head q/k norms and
o biases included) is five kernels around four GEMMs
(``tokenserve/ops/dispatch.py``: C++ when built, else torch references)::

    qkv = x @ Wqkv            rotary(q, k) + write k, v to the cache   (one kernel)
    a = paged_attention(q)    o = a @ Wo
    residual += o; x = rms_norm(residual)                             (one kernel)
    g = x @ Wgate_up          x = silu(g[:I]) * g[I:] @ Wdown          (one kernel + GEMM)
    residual += x; x = rms_norm(residual) (next layer's input norm)   (one kernel)

Other layers (:meth:`CausalLM._layer`) run the same kernels plus the family's blocks (q/k
norms, sandwich norms, windows, soft-capping, tanh-GELU, mixture of experts: :mod:`.moe`).
The whole stack runs as one C++ call a step (``csrc/decoder.cpp``, the kernels in the same
order: the same bits) when every GEMM is a C++ one and the layers are ones it computes
(:attr:`DecoderArch.fused_layers`: Llama, Qwen2/3, Mistral, Phi-3, Gemma 1/2/3, OLMo 2,
Granite; each layer handed over as data: its norms, q/k norm, window, RoPE table,
activation, soft-cap, residual scale; a RoPE table narrower than the head is partial
rotary, Phi-4-mini); MoE layers and exact GELU run the Python loop, as does everything
with ``TOKENSERVE_FUSED_DECODER=0``.

Every block computes a token's row with the same arithmetic whatever else is in the
step, so a request's logits do not depend on its batch neighbours (batch invariance; the
GEMM backends' own invariance is discussed in ``tokenserve/ops/linear.py``).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F

from tokenserve.config import env
from tokenserve.config.tree import KV_CACHE_DTYPES
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.config import (
    DecoderArch,
    ModelConfig,
    RopeSpec,
    rope_attention_factor,
    rope_inv_freq,
)
from tokenserve.models.families import family_for
from tokenserve.models.families.base import LayerWeights
from tokenserve.models.moe import MoE
from tokenserve.models.tensor_parallel import TpContext, shard_config, shard_state_dict
from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.host_memory import zeros_on_huge_pages
from tokenserve.ops.layer_ref import KV_SCALE_BYTES
from tokenserve.ops.linear import Linear, colocate_on_huge_pages, fused_linear, leaf_linears
from tokenserve.ops.quant import dequantize_ref, repack_x8
from tokenserve.ops.quant_blocks import QuantWeight

log = logging.getLogger("tokenserve.models")


class _Checkpoint:
    """HF-named tensors as the model's device and dtype want them: quantised blocks stay
    blocks on the CPU (dequantised elsewhere), float tensors are cast."""

    def __init__(self, sd: dict, dtype: torch.dtype, device: torch.device,
                 consume: bool = False) -> None:
        self.sd, self.dtype, self.device, self.consume = sd, dtype, device, consume

    def has(self, name: str) -> bool:
        return name in self.sd

    def __call__(self, name: str):
        # consume: each tensor leaves the dict as it is taken, so the loaded copy is freed
        # once its GEMM has packed its own (a 1B Q4_K_M model peaked at both copies)
        t = self.sd.pop(name) if self.consume else self.sd[name]
        if isinstance(t, QuantWeight):
            if self.device.type == "cpu":
                return t
            t = dequantize_ref(t)
        return t.to(device=self.device, dtype=self.dtype).contiguous()


def _layer_linears(layer: dict) -> list:
    """A prepared layer's projections in the order a step runs them: qkv, o, then the MLP's
    gate_up and down or the MoE's router, experts and shared expert."""
    out = [layer["qkv"], layer["o"]]
    return out + (layer["moe"].linears() if "moe" in layer else [layer["gate_up"], layer["down"]])


class CausalLM:
    """Inference-only decoder of any served family.

    Build with :meth:`from_state_dict` from HF-named tensors (``model.layers.N...``).
    """

    def __init__(self, cfg: ModelConfig, globals_: dict, layers: list[LayerWeights],
                 device: torch.device, kernels: Kernels | None = None,
                 tp: TpContext | None = None) -> None:
        self.cfg = cfg
        #: tensor parallelism: this rank's share and its collectives (``cfg`` is then the
        #: rank's own: its heads, MLP columns and vocabulary rows), or None
        self.tp = tp
        self.arch: DecoderArch = cfg.decoder_arch
        self.device = device
        self.dtype = globals_["norm"].dtype  # activations (and a KV cache of the model dtype)
        # the C++ kernels are CPU kernels; CUDA/NPU run the torch references
        self.kernels = kernels if kernels is not None else Kernels(use_c=device.type == "cpu")
        dt = self.dtype
        # fp32 logits straight out of the GEMM (bf16 logits tie far too often)
        self.lm_head = Linear(globals_["lm_head"], out_dtype=torch.float32, fallback_dtype=dt)
        self.layers = [self._prepare(lw, self.arch.layers[i].moe) for i, lw in enumerate(layers)]
        embed = globals_["embed"]
        if isinstance(embed, QuantWeight):
            if self.kernels.c is None:  # torch references
                embed = dequantize_ref(embed).to(dt)
            elif globals_["lm_head"] is embed and self.lm_head.qweight is not None:
                embed = self.lm_head.qweight  # tied: one (x8 or t16) copy of the table
            else:
                embed = repack_x8(embed, self.kernels.c)
        self.embed, self.final_norm = embed, self._norm(globals_["norm"])
        self.weight_bytes, self.weight_formats = self._weight_stats()
        log.info("weights: %.1f MiB (%s)", self.weight_bytes / 2**20, self.weight_formats)
        self.num_layers = cfg.num_layers
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = self.arch.attn_scale or cfg.head_dim ** -0.5
        #: one RoPE table per DecoderArch.ropes entry, fp32 [max_pos, rotary_dim]: cos | sin
        self.cos_sin = [self._rope_table(spec) for spec in self.arch.ropes]
        #: csrc/decoder.cpp's layer stack (one call per step), or None: the Python loop
        #: (tensor parallelism all-reduces inside each layer: the loop)
        self.decoder = self._build_decoder() if tp is None else None

    # ----------------------------------------------------------------- construction

    def _norm(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """A norm weight as the kernels take it: ``1 + w`` (computed in fp32, then the model
        dtype) for Gemma's RMSNorm, else as loaded."""
        if w is None or not self.arch.norm_offset:
            return w
        return (w.float() + 1.0).to(w.dtype)

    def _prepare(self, lw: LayerWeights, moe: bool) -> dict:
        """One layer's fused GEMMs and norms (see :class:`LayerWeights` for the roles)."""
        dt = self.dtype
        qkv_b = torch.cat(lw.qkv_bias) if lw.qkv_bias else None
        # tensor parallelism: the row-parallel GEMMs' partial sums stay fp32 until reduced
        partial = torch.float32 if self.tp is not None else None
        layer = {"qkv": fused_linear(lw.qkv, qkv_b, dt),
                 "o": Linear(lw.o, lw.o_bias, out_dtype=partial, fallback_dtype=dt)}
        for role in ("ln1", "attn_post", "ln2", "mlp_post", "q_norm", "k_norm"):
            layer[role] = self._norm(getattr(lw, role))
        if moe:
            layer["moe"] = MoE(self.arch.moe, lw, dt)
        else:
            layer["gate_up"] = fused_linear(lw.gate_up, None, dt)
            layer["down"] = Linear(lw.down, out_dtype=partial, fallback_dtype=dt)
        colocate_on_huge_pages(_layer_linears(layer))  # qkv, o, experts: on huge pages together
        return layer

    def _rope_table(self, spec: RopeSpec) -> torch.Tensor:
        inv = rope_inv_freq(spec).to(self.device)
        t = torch.arange(self.cfg.max_position_embeddings, dtype=torch.float32,
                         device=self.device)
        freqs = torch.outer(t, inv)  # [max_pos, rotary_dim / 2]
        table = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        factor = rope_attention_factor(spec, self.cfg.max_position_embeddings)
        return (table * factor if factor != 1.0 else table).contiguous()

    def _build_decoder(self):
        """``_C.Decoder`` holding every layer's prepared weights and blocks, when its fused
        stack computes these layers (:attr:`DecoderArch.fused_layers`: Llama, Qwen2/3,
        Mistral, Gemma 1/2/3, OLMo 2, Granite, Phi-3 / Phi-4-mini...), every
        projection runs on a C++ GEMM (``Linear.c_spec``) and the extension has it; None
        otherwise, and with ``TOKENSERVE_FUSED_DECODER=0`` (the Python loop, for profiling
        per kernel). Each layer is described by data: which norms it has (those the arch
        switches on), its q/k norm, window, RoPE table, activation, soft-cap and residual
        scale."""
        decoder, arch, cfg = self.kernels.op("Decoder"), self.arch, self.cfg
        if (decoder is None or self.device.type != "cpu" or not arch.fused_layers
                or self.dtype not in (torch.bfloat16, torch.float32)
                or not env.fused_decoder()):
            return None
        specs, moes = [], []  # a layer's (qkv, o, gate_up, down) specs; its MoE block or None
        for lin in self.layers:
            moe = lin["moe"].c_block(self.kernels) if "moe" in lin else None
            mlp = ("gate_up", "down") if moe is None else ()
            spec = [lin[r].c_spec() for r in ("qkv", "o") + mlp]
            if None in spec or ("moe" in lin and moe is None):
                return None
            specs.append(spec if moe is None else spec + [None, None])
            moes.append(moe)
        dec = decoder(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                      self.scale)
        qk = arch.qk_norm is not None
        for layer, spec, la, moe in zip(self.layers, specs, arch.layers, moes):
            dec.add_layer(*spec, layer["ln1"] if arch.pre_attn_norm else None,
                          layer["ln2"] if arch.pre_mlp_norm else None, window=la.window,
                          q_norm=layer["q_norm"] if qk else None,
                          k_norm=layer["k_norm"] if qk else None,
                          attn_post=layer["attn_post"] if arch.post_attn_norm else None,
                          mlp_post=layer["mlp_post"] if arch.post_mlp_norm else None,
                          qk_norm=arch.qk_norm or "head", act=arch.act,
                          softcap=arch.attn_softcap, rope=la.rope,
                          residual_scale=arch.residual_scale, moe=moe)
        dec.set_final_norm(self.final_norm)
        return dec

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, sd: dict[str, torch.Tensor | QuantWeight],
                        dtype: torch.dtype, device: torch.device,
                        kernels: Kernels | None = None, consume: bool = False,
                        tp: TpContext | None = None) -> CausalLM:
        """Build the decoder from HF-named weights through the family's tensor names.

        ``sd`` values may be :class:`~tokenserve.ops.quant_blocks.QuantWeight` (GGUF blocks, from
        ``load_weights(..., quantization="gguf")``): on a CPU they stay quantised (fused
        projections concatenate their rows when the formats agree, else the group is
        dequantised to ``dtype``); elsewhere they are dequantised.

        ``consume``: take the tensors out of ``sd`` as they are used (the engine's load: peak
        memory one copy of the weights instead of two); ``sd`` is then left without them.

        ``tp``: build rank ``tp.shard.rank``'s part only (:mod:`.tensor_parallel`: ``sd`` is
        cut to the rank's heads, MLP columns and vocabulary rows; ``sd`` is emptied).

        Raises:
            KeyError: a required tensor is missing.
            ValueError: the config's model type is not served, or (``tp``) not split.
        """
        if tp is not None:
            sd = shard_state_dict(sd, cfg, tp.shard, dtype)
            cfg = shard_config(cfg, tp.shard)
        ck = _Checkpoint(sd, dtype, device, consume)
        family = family_for({"model_type": cfg.model_type})
        arch = cfg.decoder_arch
        embed = ck("model.embed_tokens.weight")
        globals_ = {"embed": embed, "norm": ck("model.norm.weight"),
                    "lm_head": (embed if cfg.tie_word_embeddings or not ck.has("lm_head.weight")
                                else ck("lm_head.weight"))}
        layers = [family.layer(ck, i, arch) for i in range(cfg.num_layers)]
        return cls(cfg, globals_, layers, device, kernels, tp)

    # ----------------------------------------------------------------- accounting

    def linears(self) -> list[Linear]:
        """Every projection, lm_head first, then each layer's (attention, then MLP or the
        experts'); a fused projection run per part (:class:`SplitLinear`) as its parts."""
        out = [self.lm_head]
        for layer in self.layers:
            out += _layer_linears(layer)
        return leaf_linears(out)

    def _weight_stats(self) -> tuple[int, str]:
        """(bytes of weights the kernels read, formats with their tensor counts): each
        GEMM's packed or quantised copy, the embedding table (once when it is the tied
        quantised lm_head), the norms."""
        linears = self.linears()
        total = sum(lin.nbytes for lin in linears)
        formats = Counter(lin.qweight.qtype if lin.qweight is not None
                          else str(lin.weight.dtype).removeprefix("torch.") for lin in linears)
        embed = self.embed
        if isinstance(embed, QuantWeight):
            if self.lm_head.qweight is not embed:
                total += embed.nbytes
        else:
            total += embed.numel() * embed.element_size()
        norms = [self.final_norm] + [v for layer in self.layers for k, v in layer.items()
                                     if isinstance(v, torch.Tensor)]
        total += sum(v.numel() * v.element_size() for v in norms)
        return total, ", ".join(f"{k} x {n}" for k, n in sorted(formats.items()))

    # ----------------------------------------------------------------- KV cache

    def kv_cache_dtype(self, choice: str = "model") -> torch.dtype:
        """The KV cache's element type for a ``--kv-cache-dtype`` choice.

        ``model``: the model dtype (bf16 / fp32 rows). ``int8``: each (token, kv head) row
        as int8 with one fp32 scale (``csrc/cache_ops.cpp``; half the bytes a decode step
        reads from a bf16 cache). ``auto``: int8 on a CPU with the C++ kernels at bfloat16,
        else the model dtype (an explicit float32 keeps an fp32 cache).

        Raises:
            ValueError: an unknown choice.
        """
        if choice not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {choice!r}")
        if choice == "int8" or (choice == "auto" and self.device.type == "cpu"
                                and self.kernels.c is not None and self.dtype == torch.bfloat16):
            return torch.int8
        return self.dtype

    def kv_row_elements(self, kv_dtype: torch.dtype | None = None) -> int:
        """Elements of one (token, kv head) cache row: head_dim, or head_dim + 4 for int8
        (the row's fp32 scale as 4 bytes, :data:`~tokenserve.ops.layer_ref.KV_SCALE_BYTES`)."""
        D = self.cfg.head_dim
        return D + KV_SCALE_BYTES if kv_dtype == torch.int8 else D

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None,
                           num_kv_heads: int | None = None) -> int:
        """Bytes of KV cache one token takes across all layers (K and V); ``kv_dtype``
        None: the model dtype; ``num_kv_heads`` None: this model's (tensor parallelism
        asks for the rank holding the most)."""
        dt = kv_dtype or self.dtype
        heads = self.cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * self.num_layers * heads * self.kv_row_elements(dt) * dt.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int,
                          kv_dtype: torch.dtype | None = None,
                          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), each [num_blocks, Hkv, block_size, R], zeroed, of
        ``kv_dtype`` (None: the model dtype; R = :meth:`kv_row_elements`).

        All layers are views of one contiguous region ``[layers, 2, num_blocks, Hkv,
        block_size, R]`` (one registration for a KV transfer engine); on the CPU it lies on
        transparent huge pages (:mod:`tokenserve.ops.host_memory`): a decode step reads its
        blocks scattered over the region.
        """
        dt = kv_dtype or self.dtype
        shape = (num_blocks, self.cfg.num_kv_heads, block_size, self.kv_row_elements(dt))
        if self.device.type == "cpu":
            region = zeros_on_huge_pages((self.num_layers, 2, *shape), dt)
        else:
            region = torch.zeros((self.num_layers, 2, *shape), dtype=dt, device=self.device)
        return [(region[i, 0], region[i, 1]) for i in range(self.num_layers)]

    def _kv_region(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor | None:
        """The ``[layers, 2, num_blocks, Hkv, block_size, R]`` tensor ``kv_caches`` are
        views of (:meth:`allocate_kv_cache`), or None for caches laid out otherwise."""
        base = kv_caches[0][0]._base
        if (base is None or base.dim() != 6 or base.shape[0] != self.num_layers
                or base.shape[1] != 2 or len(kv_caches) != self.num_layers
                or kv_caches[0][0].data_ptr() != base.data_ptr()
                or kv_caches[-1][1].data_ptr() != base[-1, 1].data_ptr()):
            return None
        return base

    # ----------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over one step's tokens.

        Args:
            input_ids: [T] int64 token ids.
            kv_caches: from :meth:`allocate_kv_cache`; this step's K/V are written.
            meta: attention metadata for the step (positions, slots, block tables).

        Returns:
            [T, hidden_size] final hidden states (after the last RMSNorm), model dtype.
        """
        cfg, ops, arch = self.cfg, self.kernels, self.arch
        h = self._embed(input_ids)  # [T, hidden]
        if arch.embed_scale != 1.0:
            scale = (torch.tensor(arch.embed_scale, dtype=self.dtype)
                     if arch.embed_scale_rounded else arch.embed_scale)
            h = h * scale
        region = self._kv_region(kv_caches) if self.decoder is not None else None
        if region is not None:  # the same kernels in the same order, looped in C++
            x = (ops.rms_norm(h, self.layers[0]["ln1"], cfg.rms_norm_eps)
                 if arch.pre_attn_norm else h)  # without: the stack reads h (its residual)
            return self.decoder.forward(x, h, meta.positions, meta.slot_mapping,
                                        meta.block_tables, meta.query_start_loc,
                                        meta.context_lens, self.cos_sin, region)
        if not arch.llama_layers:
            for i in range(self.num_layers):
                h = self._layer(i, h, kv_caches[i], meta)
            return ops.rms_norm(h, self.final_norm, cfg.rms_norm_eps)
        residual = h
        x = ops.rms_norm(residual, self.layers[0]["ln1"], cfg.rms_norm_eps)
        for i, lin in enumerate(self.layers):
            x = self._reduce(lin["o"](self._attention(i, x, kv_caches[i], meta)))
            ops.fused_add_rms_norm(x, residual, lin["ln2"], cfg.rms_norm_eps)
            x = self._reduce(lin["down"](ops.silu_and_mul(lin["gate_up"](x))))
            nxt = self.layers[i + 1]["ln1"] if i + 1 < self.num_layers else self.final_norm
            ops.fused_add_rms_norm(x, residual, nxt, cfg.rms_norm_eps)
        return x

    def _layer(self, i: int, h: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
               meta: AttentionMetadata) -> torch.Tensor:
        """One layer of any arch (the diagram in :class:`DecoderArch`): [T, hidden] -> new
        [T, hidden] residual stream."""
        arch, lin, ops, eps = self.arch, self.layers[i], self.kernels, self.cfg.rms_norm_eps
        x = ops.rms_norm(h, lin["ln1"], eps) if arch.pre_attn_norm else h
        a = self._reduce(lin["o"](self._attention(i, x, kv, meta)))
        if arch.post_attn_norm:
            a = ops.rms_norm(a, lin["attn_post"], eps)
        h = h + a * arch.residual_scale if arch.residual_scale != 1.0 else h + a
        x = ops.rms_norm(h, lin["ln2"], eps) if arch.pre_mlp_norm else h
        if "moe" in lin:
            m = lin["moe"](x, ops)
        else:
            m = self._reduce(lin["down"](self._act_and_mul(lin["gate_up"](x))))
        if arch.post_mlp_norm:
            m = ops.rms_norm(m, lin["mlp_post"], eps)
        return h + m * arch.residual_scale if arch.residual_scale != 1.0 else h + m

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 ids -> [T, hidden] model dtype rows of the embedding table; under
        tensor parallelism each rank looks up the ids of its vocabulary rows, zeros for the
        others, and the all-reduce assembles the rows (exact: one rank contributes each)."""
        if self.tp is None:
            return self.kernels.embedding(input_ids, self.embed, self.dtype)
        v0, v1 = self.tp.shard.vocab
        local = input_ids - v0
        mine = (local >= 0) & (local < v1 - v0)
        h = self.kernels.embedding(torch.where(mine, local, 0), self.embed, self.dtype)
        h.masked_fill_(~mine.unsqueeze(1), 0)
        return self.tp.comm.all_reduce(h, self.dtype)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel GEMM's output: as it is without tensor parallelism, else every
        rank's fp32 partial sums added (:meth:`Collectives.all_reduce`) and rounded once to
        the model dtype."""
        return x if self.tp is None else self.tp.comm.all_reduce(x, self.dtype)

    def _act_and_mul(self, g: torch.Tensor) -> torch.Tensor:
        """``act(g[:, :I]) * g[:, I:]`` of a fused gate|up output [T, 2I] -> [T, I], computed
        in fp32 with one rounding (as the SiLU kernel)."""
        if self.arch.act == "silu":
            return self.kernels.silu_and_mul(g)
        if self.arch.act == "gelu_tanh":  # a kernel, which csrc/decoder.cpp's stack runs too
            return self.kernels.gelu_tanh_and_mul(g)
        gate, up = g.float().chunk(2, dim=-1)  # exact GELU (Gemma 1 may name it)
        return (F.gelu(gate) * up).to(g.dtype)

    def _attention(self, i: int, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata) -> torch.Tensor:
        """Layer ``i``'s attention up to (not including) the output projection:
        [T, hidden] -> [T, H * head_dim]. Writes this step's K/V into ``kv``."""
        cfg, arch, ops, lin = self.cfg, self.arch, self.kernels, self.layers[i]
        T, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = lin["qkv"](x)  # [T, (H + 2 Hkv) D]
        if arch.qk_norm is not None:
            self._qk_norm(qkv, lin["q_norm"], lin["k_norm"])
        layer = arch.layers[i]
        k_cache, v_cache = kv
        # partial rotary (Phi-4-mini): the layer's table is [max_pos, rotary_dim] and the
        # kernel rotates that many dims of each head
        ops.rotary_embedding_write_kv(qkv, meta.positions, self.cos_sin[layer.rope],
                                      k_cache, v_cache, meta.slot_mapping, H, Hkv)
        q = qkv[:, :self.q_size].view(T, H, D)
        extra = {}
        if layer.window:
            extra["window"] = layer.window
        if arch.attn_softcap:
            extra["softcap"] = arch.attn_softcap
        a = ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                meta.context_lens, self.scale, **extra)
        return a.view(T, self.q_size)

    def _qk_norm(self, qkv: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor) -> None:
        """In place: RMSNorm of q and k inside ``qkv`` [T, (H + 2 Hkv) D], per head
        (``head``: weight [D]) or over the whole projection (``full``: [H D] / [Hkv D])."""
        cfg, ops = self.cfg, self.kernels
        T, D = qkv.shape[0], cfg.head_dim
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        for lo, hi, w in ((0, q_end, wq), (q_end, k_end, wk)):
            part = qkv[:, lo:hi]
            rows = part.reshape(-1, D) if self.arch.qk_norm == "head" else part.contiguous()
            part.copy_(ops.rms_norm(rows.contiguous(), w, cfg.rms_norm_eps).view(T, hi - lo))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden_size] model dtype -> [S, vocab_size] float32 logits (the GEMM
        accumulates in fp32 and never rounds to the model dtype); Granite's divisor and
        Gemma 2's final soft-capping ``c * tanh(l / c)`` applied in fp32. Under tensor
        parallelism a collective: every rank computes its vocabulary rows' logits and all
        of them are gathered (each rank gets the whole [S, vocab_size])."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.comm.all_gather_cols(logits)
        if self.arch.logits_divisor != 1.0:
            logits = logits / self.arch.logits_divisor
        if self.arch.final_softcap:
            cap = self.arch.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


    def close(self) -> None:
        """Nothing to release (a tensor-parallel rank 0's stand-in,
        ``tokenserve.engine.tensor_parallel.TpModel``, stops its ranks here)."""

    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """:meth:`compute_logits` of ``hidden`` [T, hidden_size]'s ``rows`` -> [len(rows),
        vocab_size] float32 (a step's sampled rows; under tensor parallelism every rank
        names the same rows of its own, identical, hidden states)."""
        return self.compute_logits(hidden.index_select(
            0, torch.tensor(rows, dtype=torch.int64, device=hidden.device)))

