"""Tiny random-weight models of every served family, built by transformers in the test.

Each is 2-4 layers of hidden 64, GQA (4 query heads, 2 KV heads), with its family's
distinguishing features switched on and made to matter: norm weights and biases drawn at
random (not transformers' ones / zeros), sliding windows shorter than prompt + output,
Granite's multipliers away from 1, Gemma 2's soft-caps low enough to bite, MoE routers with
a spread of experts. Weights are drawn with a larger spread than transformers' initialiser
(``std`` 0.25) so the logits are peaked and greedy decoding has clear winners.

``build(family, dir)`` saves the model (``save_pretrained``) with the default model's
tokenizer files beside it, so the directory is servable by ``tokenserve serve --model``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as T

from tokenserve.models.loader import resolve_model

VOCAB = 49152  # the default model's tokenizer (SmolLM2)
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
WINDOW = 12  # shorter than the tests' prompt + output

#: family name -> (transformers config class, its extra arguments)
FAMILIES: dict[str, tuple[type, dict]] = {
    "llama": (T.LlamaConfig, dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64},
                                  tie_word_embeddings=True)),
    "llama_bias": (T.LlamaConfig, dict(attention_bias=True)),
    "mistral": (T.MistralConfig, dict(sliding_window=WINDOW, head_dim=16)),
    "qwen2": (T.Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=1, num_hidden_layers=3)),
    "qwen3": (T.Qwen3Config, dict(head_dim=16)),
    "gemma": (T.GemmaConfig, dict(head_dim=16, tie_word_embeddings=True)),
    "gemma2": (T.Gemma2Config, dict(head_dim=16, sliding_window=WINDOW,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                    query_pre_attn_scalar=24, tie_word_embeddings=True)),
    "gemma3_text": (T.Gemma3TextConfig, dict(head_dim=16, sliding_window=WINDOW,
                                             num_hidden_layers=3,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention"],
                                             rope_parameters={
                                                 "full_attention": {"rope_type": "linear",
                                                                    "factor": 4.0,
                                                                    "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 1e4}},
                                             query_pre_attn_scalar=24,
                                             tie_word_embeddings=True)),
    "phi3": (T.Phi3Config, dict(partial_rotary_factor=0.75, sliding_window=WINDOW)),
    "olmo2": (T.Olmo2Config, {}),
    "granite": (T.GraniteConfig, dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                                      residual_multiplier=0.5, logits_scaling=2.0)),
    "mixtral": (T.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (T.Qwen2MoeConfig, dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": (T.Qwen3MoeConfig, dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, head_dim=16,
                                         norm_topk_prob=True)),
}


def hf_config(family: str):
    """The transformers config of ``family`` (a key of :data:`FAMILIES`)."""
    cls, extra = FAMILIES[family]
    return cls(**{**COMMON, **extra})


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter drawn anew: norms around their neutral value (1, or 0 for Gemma's
    ``1 + w``) with spread 0.3, everything else N(0, 0.25^2)."""
    g = torch.Generator().manual_seed(seed)
    offset = model.config.model_type.startswith("gemma")
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if "norm" in name and p.dim() == 1:
            p.copy_((0.0 if offset else 1.0) + 0.3 * noise)
        else:
            p.copy_(0.25 * noise)


def build(family: str, d: Path, seed: int = 0):
    """Save ``family``'s tiny random model (fp32) and the default model's tokenizer under
    ``d``; returns transformers' model (eval, fp32)."""
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(hf_config(family)).eval().float()
    randomize(model, seed)
    model.save_pretrained(d)
    tok_dir = resolve_model(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, d / name)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy ``generate`` (fp32, no EOS stop)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
