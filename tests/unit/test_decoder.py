"""csrc/decoder.cpp (``_C.Decoder``): the layer stack looped in C++ gives the same bits as
CausalLM's Python loop over the same kernels: hidden states and the KV cache, for
a mixed step (a prefill chunk behind a cached prefix next to decodes), in fp32 and bf16,
on bf16/fp32 GEMMs, GGUF Q4_0/Q4_1/Q8_0 blocks, Q4_K/Q5_K/Q6_K super-blocks and int8
weights, with q/k/v biases."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_checks import assert_releases_gil
from tokenserve.models.attention import AttentionMetadata
from tokenserve.models.config import ModelConfig
from tokenserve.models.decoder import CausalLM
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.linear import SplitLinear
from tokenserve.ops.quant import quantize_ref
from tokenserve.ops.quant_blocks import BLOCK_BYTES, K_QTYPES, QuantWeight
from tokenserve.ops.quant_int8 import quantize_int8

C = load_kernels()
pytestmark = pytest.mark.skipif(C is None or not hasattr(C, "Decoder"),
                                reason="tokenserve._C (Decoder) not built")

BLOCK = 8


def _cfg(bias: bool, wide: bool = False) -> ModelConfig:
    """A 3-layer GQA model; ``wide``: every K = 256 (the k-quant super-block)."""
    hidden, inter, hd = (256, 256, 64) if wide else (64, 96, 16)
    return ModelConfig(
        name="tiny", model_type="qwen2" if bias else "llama", vocab_size=96, hidden_size=hidden,
        intermediate_size=inter, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=hd,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
        tie_word_embeddings=True, attention_bias=bias, sliding_window=None, bos_token_id=1,
        eos_token_ids=(2,), torch_dtype="float32")


#: "mixed_k": a GGUF Q4_K_M layer's mix, fused tensors whose parts differ in format (q, k,
#: gate in Q4_K; v, up in Q6_K; o, down in Q4_K)
MIXED_K = {"v_proj": "q6_k", "up_proj": "q6_k"}


def _state_dict(cfg: ModelConfig, quant: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def w(n: int, k: int, scale: float = 0.08, role: str = ""):
        quant_ = MIXED_K.get(role, "q4_k") if quant == "mixed_k" else quant
        return _w(n, k, scale, quant_)

    def _w(n: int, k: int, scale: float, quant: str):
        if quant in K_QTYPES:  # random valid super-blocks, fp16 d (and dmin) in [2^-9, 2^-7)
            data = torch.randint(0, 256, (n, k // 256, BLOCK_BYTES[quant]), generator=g,
                                 dtype=torch.uint8)
            f16 = (torch.rand(n, k // 256, 2, generator=g) * 2**-8 + 2**-9).half()
            f16 = f16.view(torch.uint8)  # [n, super-blocks, 4]: d then dmin
            if quant == "q6_k":  # ggml block_q6_K: d last
                data[..., 208:210] = f16[..., :2]
            else:  # block_q4_K / block_q5_K: d, dmin first
                data[..., 0:4] = f16
            return QuantWeight(data.reshape(n, -1).contiguous(), quant, (n, k))
        t = torch.randn(n, k, generator=g) * scale
        if quant == "int8":
            return quantize_int8(t)
        if quant in ("q4_0", "q4_1", "q8_0"):
            return quantize_ref(t, quant)
        return t

    H, D, Hkv, I = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, H, generator=g),
          "model.norm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = w(cfg.num_heads * D, H)
        sd[p + "self_attn.k_proj.weight"] = w(Hkv * D, H)
        sd[p + "self_attn.v_proj.weight"] = w(Hkv * D, H, role="v_proj")
        if cfg.attention_bias:
            for n, width in (("q", cfg.num_heads * D), ("k", Hkv * D), ("v", Hkv * D)):
                sd[p + f"self_attn.{n}_proj.bias"] = 0.1 * torch.randn(width, generator=g)
        sd[p + "self_attn.o_proj.weight"] = w(H, cfg.num_heads * D)
        sd[p + "mlp.gate_proj.weight"] = w(I, H)
        sd[p + "mlp.up_proj.weight"] = w(I, H, role="up_proj")
        sd[p + "mlp.down_proj.weight"] = w(H, I)
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    return sd


def _run(model: CausalLM, use_decoder: bool, kv_dtype=None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill of 11 tokens for seq 0 and of 5 for seq 1, then one step with a 6-token
    chunk of seq 0 behind its cached 11 and a decode of seq 1: (last hidden, KV region)."""
    saved, model.decoder = model.decoder, (model.decoder if use_decoder else None)
    try:
        kv = model.allocate_kv_cache(num_blocks=8, block_size=BLOCK, kv_dtype=kv_dtype)
        tables = [[5, 2, 7], [0, 3]]
        g = torch.Generator().manual_seed(1)
        ids = [torch.randint(3, 96, (17,), generator=g), torch.randint(3, 96, (6,), generator=g)]
        for q_lens, done in (((11, 5), (0, 0)), ((6, 1), (11, 5))):
            meta = AttentionMetadata.build(model.kernels, tables, list(q_lens), list(done), BLOCK)
            step = torch.cat([ids[s][done[s]:done[s] + q_lens[s]] for s in range(2)])
            hidden = model.forward(step, kv, meta)
        return hidden, kv[0][0]._base.clone()
    finally:
        model.decoder = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant,bias", [("none", False), ("none", True), ("q4_0", False),
                                        ("q4_1", True), ("q8_0", False), ("int8", False),
                                        ("q4_k", False), ("q5_k", True), ("q6_k", False),
                                        ("mixed_k", True)])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_decoder_equals_python_loop(dtype, quant, bias, kv_dtype):
    cfg = _cfg(bias, wide=quant in K_QTYPES or quant == "mixed_k")
    model = CausalLM.from_state_dict(cfg, _state_dict(cfg, quant), dtype,
                                             torch.device("cpu"))
    assert model.decoder is not None and model.decoder.num_layers == cfg.num_layers
    if quant == "mixed_k":  # the fused tensors run per part (csrc/proj_spec.h kind 5)
        layer = model.layers[0]
        assert isinstance(layer["qkv"], SplitLinear) and isinstance(layer["gate_up"], SplitLinear)
        assert [p.qweight.qtype for p in layer["qkv"].parts] == ["q4_k", "q6_k"]
        assert layer["qkv"].c_spec()[0] == 5
    h_c, kv_c = _run(model, True, kv_dtype)
    h_py, kv_py = _run(model, False, kv_dtype)
    assert kv_c.dtype == (kv_dtype or dtype)
    assert h_c.dtype == dtype and h_c.shape == (7, cfg.hidden_size)
    assert torch.equal(h_c, h_py)
    assert torch.equal(kv_c, kv_py)
    assert torch.isfinite(h_c.float()).all()


def test_decoder_off_by_env_and_for_foreign_caches(monkeypatch):
    cfg = _cfg(False)
    sd = _state_dict(cfg, "none")
    monkeypatch.setenv("TOKENSERVE_FUSED_DECODER", "0")
    assert CausalLM.from_state_dict(cfg, dict(sd), torch.float32,
                                            torch.device("cpu")).decoder is None
    monkeypatch.delenv("TOKENSERVE_FUSED_DECODER")
    model = CausalLM.from_state_dict(cfg, dict(sd), torch.float32, torch.device("cpu"))
    assert model.decoder is not None
    # caches not laid out by allocate_kv_cache: the Python loop runs them
    shape = (4, cfg.num_kv_heads, BLOCK, cfg.head_dim)
    foreign = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    assert model._kv_region(foreign) is None
    assert model._kv_region(model.allocate_kv_cache(4, BLOCK)) is not None


def test_decoder_rejects_bad_specs_and_regions():
    dec = C.Decoder(4, 2, 16, 1e-5, 0.25)
    with pytest.raises(RuntimeError, match="kind"):
        dec.add_layer((7, torch.zeros(1), None, 0, 1, None), (0, torch.zeros(1), None, 0, 1, None),
                      (0, torch.zeros(1), None, 0, 1, None), (0, torch.zeros(1), None, 0, 1, None),
                      torch.ones(64), torch.ones(64))
    with pytest.raises(RuntimeError, match="no layers"):
        dec.forward(torch.zeros(1, 64), torch.zeros(1, 64), torch.zeros(1, dtype=torch.long),
                    torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                    torch.zeros(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                    torch.zeros(8, 16), torch.zeros(1, 2, 1, 2, 8, 16))


def test_decoder_releases_the_gil():
    """The whole layer stack runs without the GIL: the server's event loop keeps serving
    while the model thread is in a forward pass (here prefills of 8 x 128 tokens)."""
    cfg = _cfg(False, wide=True)
    model = CausalLM.from_state_dict(cfg, _state_dict(cfg, "none"), torch.float32,
                                             torch.device("cpu"))
    assert model.decoder is not None
    S, L = 8, cfg.max_position_embeddings
    per = L // BLOCK
    kv = model.allocate_kv_cache(num_blocks=S * per, block_size=BLOCK)
    tables = [list(range(s * per, (s + 1) * per)) for s in range(S)]
    meta = AttentionMetadata.build(model.kernels, tables, [L] * S, [0] * S, BLOCK)
    ids = torch.randint(3, 96, (S * L,), generator=torch.Generator().manual_seed(0))
    assert_releases_gil(lambda: model.forward(ids, kv, meta))


def test_kv_cache_dtype_choices():
    """``auto`` is int8 on a CPU with the C++ kernels at bfloat16 and the model dtype
    otherwise; ``model`` / ``int8`` as asked; the bytes a token takes follow the rows."""
    from tokenserve.config.tree import EngineConfig
    from tokenserve.ops.dispatch import Kernels

    cfg = _cfg(False)
    sd = _state_dict(cfg, "none")
    cpu = torch.device("cpu")
    bf16 = CausalLM.from_state_dict(cfg, dict(sd), torch.bfloat16, cpu)
    fp32 = CausalLM.from_state_dict(cfg, dict(sd), torch.float32, cpu)
    ref = CausalLM.from_state_dict(cfg, dict(sd), torch.bfloat16, cpu, Kernels(use_c=False))
    assert bf16.kv_cache_dtype("auto") == torch.int8
    assert fp32.kv_cache_dtype("auto") == torch.float32
    assert ref.kv_cache_dtype("auto") == torch.bfloat16  # the torch references: model dtype
    assert bf16.kv_cache_dtype("model") == torch.bfloat16
    assert fp32.kv_cache_dtype("int8") == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        bf16.kv_cache_dtype("fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    L, Hkv, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert bf16.kv_bytes_per_token() == 2 * L * Hkv * D * 2
    assert bf16.kv_bytes_per_token(torch.int8) == 2 * L * Hkv * (D + 4)
