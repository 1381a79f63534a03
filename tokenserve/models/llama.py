"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Follows Hugging Face ``LlamaForCausalLM`` numerics (RMSNorm in fp32, rotate-half RoPE,
SiLU-gated MLP, grouped-query attention) so that fp32 logits match it tightly; the
weights are fused at load time (q|k|v into one matmul, gate|up into one) because on
CPU fewer, larger GEMMs are markedly faster.

The forward pass takes a flattened batch of tokens (no padding) plus
:class:`~tokenserve.models.attention.AttentionMetadata`; see ``attention.py`` for the
cache layout and slot mapping. Each layer is five kernels around four GEMMs
(``tokenserve/ops/dispatch.py``: C++ when built, else torch references)::

    qkv = x @ Wqkv            rotary(q, k) + write k, v to the cache   (one kernel)
    a = paged_attention(q)    o = a @ Wo
    residual += o; x = rms_norm(residual)                             (one kernel)
    g = x @ Wgate_up          x = silu(g[:I]) * g[I:] @ Wdown          (one kernel + GEMM)
    residual += x; x = rms_norm(residual) (next layer's input norm)   (one kernel)

Every kernel computes a token's row with the same arithmetic whatever else is in the
step, so a request's logits do not depend on its batch neighbours (batch invariance;
the GEMM backends' own invariance is discussed in ``tokenserve/ops/linear.py``).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from tokenserve.config import env
from tokenserve.config.tree import KV_CACHE_DTYPES
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.loader import ModelConfig, rope_inv_freq
from tokenserve.ops.dispatch import Kernels
from tokenserve.ops.host_memory import zeros_on_huge_pages
from tokenserve.ops.layer_ref import KV_SCALE_BYTES
from tokenserve.ops.linear import Linear
from tokenserve.ops.quant import dequantize_ref, repack_x8
from tokenserve.ops.quant_blocks import QuantWeight

log = logging.getLogger("tokenserve.models")


class LlamaForCausalLM:
    """Inference-only Llama decoder.

    Build with :meth:`from_state_dict` from HF-named tensors (``model.layers.N...``).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, kernels: Kernels | None = None) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = weights["norm"].dtype  # activations (and a KV cache of the model dtype)
        self.w = weights
        # the C++ kernels are CPU kernels; CUDA/NPU run the torch references
        self.kernels = kernels if kernels is not None else Kernels(use_c=device.type == "cpu")
        dt = self.dtype
        # fp32 logits straight out of the GEMM (bf16 logits tie far too often)
        self.lm_head = Linear(weights["lm_head"], out_dtype=torch.float32, fallback_dtype=dt)
        self.layers = [
            {"qkv": Linear(weights[f"{i}.qkv"], weights.get(f"{i}.qkv_b"), fallback_dtype=dt),
             "o": Linear(weights[f"{i}.o"], fallback_dtype=dt),
             "gate_up": Linear(weights[f"{i}.gate_up"], fallback_dtype=dt),
             "down": Linear(weights[f"{i}.down"], fallback_dtype=dt)}
            for i in range(cfg.num_layers)]
        embed = weights["embed"]
        if isinstance(embed, QuantWeight):
            if self.kernels.c is None:  # torch references
                weights["embed"] = dequantize_ref(embed).to(dt)
            elif weights["lm_head"] is embed and self.lm_head.qweight is not None:
                weights["embed"] = self.lm_head.qweight  # tied: one (x8 or t16) copy of the table
            else:
                weights["embed"] = repack_x8(embed)
        # the GEMMs hold their own (packed or quantised) copies of the projections
        self.w = {k: v for k, v in weights.items()
                  if k in ("embed", "norm") or k.endswith((".ln1", ".ln2"))}
        self.weight_bytes, self.weight_formats = self._weight_stats()
        log.info("weights: %.1f MiB (%s)", self.weight_bytes / 2**20, self.weight_formats)
        self.num_layers = cfg.num_layers
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        #: csrc/decoder.cpp's layer stack (one call per step), or None: the Python loop
        self.decoder = self._build_decoder()
        inv = rope_inv_freq(cfg).to(device)
        t = torch.arange(cfg.max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)  # [max_pos, head_dim / 2]
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()  # fp32

    def _build_decoder(self):
        """``_C.Decoder`` holding every layer's prepared weights, when every projection runs
        on a C++ GEMM (``Linear.c_spec``) and the extension has it; None otherwise, and
        with ``TOKENSERVE_FUSED_DECODER=0`` (the Python loop, for profiling per kernel)."""
        decoder = self.kernels.op("Decoder")
        if (decoder is None or self.device.type != "cpu"
                or self.dtype not in (torch.bfloat16, torch.float32)
                or not env.fused_decoder()):
            return None
        specs = [[lin[r].c_spec() for r in ("qkv", "o", "gate_up", "down")] for lin in self.layers]
        if any(s is None for layer in specs for s in layer):
            return None
        cfg = self.cfg
        dec = decoder(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                      cfg.head_dim ** -0.5)
        for i, layer in enumerate(specs):
            dec.add_layer(*layer, self.w[f"{i}.ln1"], self.w[f"{i}.ln2"])
        dec.set_final_norm(self.w["norm"])
        return dec

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

    def linears(self) -> list[Linear]:
        """Every projection, lm_head first, then each layer's qkv, o, gate_up, down."""
        return [self.lm_head] + [lin for layer in self.layers for lin in layer.values()]

    def _weight_stats(self) -> tuple[int, str]:
        """(bytes of weights the kernels read, formats with their tensor counts): each
        GEMM's packed or quantised copy, the embedding table (once when it is the tied
        quantised lm_head), the norms."""
        linears = self.linears()
        total = sum(lin.nbytes for lin in linears)
        formats = Counter(lin.qweight.qtype if lin.qweight is not None
                          else str(lin.weight.dtype).removeprefix("torch.") for lin in linears)
        embed = self.w["embed"]
        if isinstance(embed, QuantWeight):
            if self.lm_head.qweight is not embed:
                total += embed.nbytes
        else:
            total += embed.numel() * embed.element_size()
        total += sum(v.numel() * v.element_size() for k, v in self.w.items()
                     if k == "norm" or k.endswith((".ln1", ".ln2")))
        return total, ", ".join(f"{k} x {n}" for k, n in sorted(formats.items()))

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, sd: dict[str, torch.Tensor | QuantWeight],
                        dtype: torch.dtype, device: torch.device,
                        kernels: Kernels | None = None) -> LlamaForCausalLM:
        """Fuse HF-named weights into this model's layout.

        ``sd`` values may be :class:`~tokenserve.ops.quant_blocks.QuantWeight` (GGUF blocks, from
        ``load_weights(..., quantization="gguf")``): on a CPU they stay quantised (fused
        projections concatenate their rows when the formats agree, else the group is
        dequantised to ``dtype``); elsewhere they are dequantised.

        Raises:
            KeyError: a required tensor is missing.
        """
        def g(name: str) -> torch.Tensor | QuantWeight:
            t = sd[name]
            if isinstance(t, QuantWeight):
                if device.type == "cpu":
                    return t
                t = dequantize_ref(t)
            return t.to(device=device, dtype=dtype).contiguous()

        def cat(parts: list[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
            if (all(isinstance(p, QuantWeight) for p in parts)
                    and len({(p.qtype, p.shape[1]) for p in parts}) == 1):
                return QuantWeight.cat(parts)
            return torch.cat([dequantize_ref(p).to(dtype) if isinstance(p, QuantWeight) else p
                              for p in parts])

        w: dict[str, torch.Tensor] = {"embed": g("model.embed_tokens.weight"),
                                      "norm": g("model.norm.weight")}
        w["lm_head"] = (w["embed"] if cfg.tie_word_embeddings or "lm_head.weight" not in sd
                        else g("lm_head.weight"))
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            w[f"{i}.qkv"] = cat([g(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            if cfg.attention_bias:
                w[f"{i}.qkv_b"] = torch.cat([g(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            w[f"{i}.o"] = g(p + "self_attn.o_proj.weight")
            w[f"{i}.gate_up"] = cat([g(p + "mlp.gate_proj.weight"), g(p + "mlp.up_proj.weight")])
            w[f"{i}.down"] = g(p + "mlp.down_proj.weight")
            w[f"{i}.ln1"] = g(p + "input_layernorm.weight")
            w[f"{i}.ln2"] = g(p + "post_attention_layernorm.weight")
        return cls(cfg, w, device, kernels)

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

    def kv_bytes_per_token(self, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes of KV cache one token takes across all layers (K and V); ``kv_dtype``
        None: the model dtype."""
        dt = kv_dtype or self.dtype
        return (2 * self.num_layers * self.cfg.num_kv_heads * self.kv_row_elements(dt)
                * dt.itemsize)

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
        cfg, w, ops = self.cfg, self.w, self.kernels
        T = input_ids.shape[0]
        residual = ops.embedding(input_ids, w["embed"], self.dtype)  # [T, hidden]
        x = ops.rms_norm(residual, w["0.ln1"], cfg.rms_norm_eps)
        region = self._kv_region(kv_caches) if self.decoder is not None else None
        if region is not None:  # the same kernels in the same order, looped in C++
            return self.decoder.forward(x, residual, meta.positions, meta.slot_mapping,
                                        meta.block_tables, meta.query_start_loc,
                                        meta.context_lens, self.cos_sin, region)
        for i, lin in enumerate(self.layers):
            qkv = lin["qkv"](x)  # [T, (H + 2 Hkv) D]
            k_cache, v_cache = kv_caches[i]
            ops.rotary_embedding_write_kv(qkv, meta.positions, self.cos_sin, k_cache, v_cache,
                                          meta.slot_mapping, cfg.num_heads, cfg.num_kv_heads)
            q = qkv[:, :self.q_size].view(T, cfg.num_heads, cfg.head_dim)
            a = ops.paged_attention(q, k_cache, v_cache, meta.block_tables,
                                    meta.query_start_loc, meta.context_lens, self.scale)
            x = lin["o"](a.view(T, self.q_size))
            ops.fused_add_rms_norm(x, residual, w[f"{i}.ln2"], cfg.rms_norm_eps)
            x = lin["down"](ops.silu_and_mul(lin["gate_up"](x)))
            nxt = w[f"{i + 1}.ln1"] if i + 1 < self.num_layers else w["norm"]
            ops.fused_add_rms_norm(x, residual, nxt, cfg.rms_norm_eps)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden_size] model dtype -> [S, vocab_size] float32 logits (the GEMM
        accumulates in fp32 and never rounds to the model dtype)."""
        return self.lm_head(hidden)
