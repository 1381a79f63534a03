"""The one place that chooses between ``tokenserve._C`` and its torch references.

:func:`load_kernels` loads the extension (or says it is absent) and :meth:`Kernels.op` /
:func:`c_op` say whether it has a given kernel; every caller asks these and never the
extension itself: the model and the runner through :class:`Kernels` (one entry point per
kernel, decided once, at construction), the GEMMs (``tokenserve/ops/linear.py``), the
sampler (``tokenserve/engine/sampler.py``). Every method's contract (shapes, dtypes,
in-place behaviour) is the C++ kernel's, documented beside its reference
(``tokenserve/ops/reference.py``, ``tokenserve/ops/layer_ref.py``).

Set ``TOKENSERVE_DISABLE_C=1`` to run on the references alone (what the "with and without
``_C``" tests compare), or ``TOKENSERVE_KERNELS_SO=path`` to load a development build of
some kernels (``tools/dev_kernels.py``) in its place.

KV cache layout, one tensor per layer for K and one for V::

    k_cache: [num_blocks, num_kv_heads, block_size, head_dim]   (model dtype)
         or  [num_blocks, num_kv_heads, block_size, head_dim + 4] int8 (values + fp32 scale,
             ``ops.layer_ref.quantize_kv_rows``; ``--kv-cache-dtype``)

Position ``p`` of a sequence with block table ``bt`` lives in block ``bt[p // block_size]``,
row ``p % block_size``; its flat *slot* is ``bt[p // block_size] * block_size +
p % block_size``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from tokenserve.config import env
from tokenserve.ops import layer_ref, reference
from tokenserve.ops.quant import dequantize_rows_ref
from tokenserve.ops.quant_blocks import QTYPE_IDS, QuantWeight


def load_kernels() -> ModuleType | None:
    """``tokenserve._C``, or None when it is disabled (``TOKENSERVE_DISABLE_C=1``), not
    built, or built against another ABI (a ``sys.modules`` look-up after the first call).

    Returns:
        the extension module (its ``cpu_features()`` says which code paths run), or None.
    """
    if env.disable_c():
        return None
    try:
        if dev := env.kernels_so():  # a tools/dev_kernels.py build
            name = Path(dev).name.split(".")[0]
            mod = sys.modules.get(name)
            if mod is None:
                spec = importlib.util.spec_from_file_location(name, dev)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                sys.modules[name] = mod
        else:
            mod = importlib.import_module("tokenserve._C")
    except ImportError:
        return None
    return mod if getattr(mod, "ABI_VERSION", None) == 2 else None


def c_op(name: str) -> Callable | None:
    """``tokenserve._C.<name>`` when the extension loads (:func:`load_kernels`) and has that
    kernel, else None (the caller then runs its torch reference)."""
    return Kernels().op(name)


class Kernels:
    """The step's kernels: C++ (``self.c`` is the extension) or pure torch (``self.c`` None).

    Args:
        use_c: False forces the torch references even where the extension is built.
    """

    def __init__(self, use_c: bool = True) -> None:
        self.c: ModuleType | None = load_kernels() if use_c else None

    def op(self, name: str) -> Callable | None:
        """The extension's kernel ``name`` when this object runs the extension and it has
        that kernel, else None."""
        return getattr(self.c, name, None) if self.c is not None else None

    def describe(self) -> str:
        """Which implementation runs, for the start-up log: ``tokenserve._C (CPU paths:
        avx2_fma)`` or ``torch references (why)``."""
        if self.c is None:
            return "torch references (" + ("tokenserve._C not built or disabled"
                                           if load_kernels() is None else "not a CPU device") + ")"
        feats = [k for k, on in self.c.cpu_features().items() if on]
        return f"tokenserve._C (CPU paths: {', '.join(feats) or 'portable'})"

    # ----------------------------------------------------------------- step metadata

    def positions_and_slots(self, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            context_lens: torch.Tensor, block_size: int,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and cache slots of a step's tokens.

        Args:
            block_tables: int32 [S, max_blocks].
            query_start_loc: int32 [S + 1], sequence ``s`` owns tokens
                ``[qsl[s], qsl[s+1])`` of the step.
            context_lens: int32 [S], tokens in the cache after this step (>= q_len).
            block_size: tokens per block.

        Returns:
            (positions int64 [T], slot_mapping int64 [T]): a sequence's tokens are the last
            ``q_len`` of its context.
        """
        if self.c is not None:
            return self.c.positions_and_slots(block_tables, query_start_loc, context_lens,
                                              block_size)
        return layer_ref.positions_and_slots_ref(block_tables, query_start_loc, context_lens,
                                                 block_size)

    # ----------------------------------------------------------------- one decoder layer

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor | QuantWeight,
                  dtype: torch.dtype) -> torch.Tensor:
        """Rows ``input_ids`` (int64 [T]) of the embedding table, [T, hidden] in ``dtype``.
        A quantised table (GGUF blocks, k-quants too) is dequantised row by row in C++, as
        :func:`tokenserve.ops.quant.dequantize_rows_ref` does."""
        if not isinstance(weight, QuantWeight):
            return F.embedding(input_ids, weight)
        rows = self.op({"x8": "quant_dequant_rows", "t16": "quant_t16_dequant_rows",
                        "k8": "quant_k_dequant_rows"}.get(weight.layout, ""))
        if rows is not None:
            return rows(input_ids, weight.data, QTYPE_IDS[weight.qtype], weight.shape[0],
                        weight.shape[1], dtype)
        return dequantize_rows_ref(input_ids, weight, dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of [T, hidden] rows (HF Llama numerics); returns a new [T, hidden]."""
        out = torch.empty_like(x)
        (self.c.rms_norm if self.c is not None else layer_ref.rms_norm_ref)(out, x, weight, eps)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float) -> None:
        """In place: ``residual += x``; ``x = rms_norm(residual)`` ([T, hidden] each)."""
        if self.c is not None:
            self.c.fused_add_rms_norm(x, residual, weight, eps)
        else:
            layer_ref.fused_add_rms_norm_ref(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x[:, :I]) * x[:, I:]`` of the fused gate|up output [T, 2I]: new [T, I]."""
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
        (self.c.silu_and_mul if self.c is not None else layer_ref.silu_and_mul_ref)(out, x)
        return out

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(x[:, :I]) * x[:, I:]`` (torch's ``F.gelu(approximate="tanh")``, fp32,
        one rounding) of the fused gate|up output [T, 2I]: new [T, I]."""
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
        kernel = self.op("gelu_tanh_and_mul") or layer_ref.gelu_tanh_and_mul_ref
        kernel(out, x)
        return out

    def rotary_embedding_write_kv(self, qkv: torch.Tensor, positions: torch.Tensor,
                                  cos_sin: torch.Tensor, k_cache: torch.Tensor,
                                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                  num_heads: int, num_kv_heads: int) -> None:
        """In place: rotary embedding on q and k inside the fused ``qkv`` [T, (H+2Hkv)*D],
        then k and v written to the cache at ``slot_mapping`` (int64 [T]).
        ``cos_sin``: fp32 [max_pos, D], cos in the first half, sin in the second."""
        if self.c is not None:
            self.c.rotary_embedding_write_kv(qkv, positions, cos_sin, k_cache, v_cache,
                                             slot_mapping, num_heads, num_kv_heads)
        else:
            layer_ref.rotary_embedding_write_kv_ref(qkv, positions, cos_sin, k_cache, v_cache,
                                                    slot_mapping, num_heads, num_kv_heads)

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
        """Causal attention of a step's queries over the paged cache.

        Args:
            q: [T, H, D] queries (a strided view of ``qkv`` is fine: stride(2) == 1,
                stride(1) == D).
            k_cache, v_cache: [num_blocks, Hkv, block_size, D] (q's dtype) or int8
                ``[..., D + 4]``, this step's K/V written.
            block_tables, query_start_loc, context_lens: as in :meth:`positions_and_slots`.
            scale: softmax scale (``D ** -0.5``).
            window: sliding window (tokens), 0 = none; softcap: attention logit
                soft-capping, 0 = none (both as :func:`reference.paged_attention_ref`).

        Returns:
            [T, H, D] in q's dtype.
        """
        if self.c is not None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            self.c.paged_attention(out, q, k_cache, v_cache, block_tables, query_start_loc,
                                   context_lens, scale, window, softcap)
            return out
        return reference.paged_attention_ref(q, k_cache, v_cache, block_tables,
                                             query_start_loc, context_lens, scale, window, softcap)

    def copy_blocks(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                    block_mapping: torch.Tensor) -> None:
        """Copy whole blocks in every layer: int64 [N, 2] (src, dst) pairs."""
        if self.c is not None:
            self.c.copy_blocks(k_caches, v_caches, block_mapping)
        else:
            layer_ref.copy_blocks_ref(k_caches, v_caches, block_mapping)
