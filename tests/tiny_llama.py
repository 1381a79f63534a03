"""A tiny random Llama (2 layers, vocabulary 97) as transformers builds it and as ours loads
it from the same saved weights, fp32: the reference pair of the model-level unit tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tokenserve.models.decoder import CausalLM
from tokenserve.models.loader import load_config, load_weights


def tiny_llama_pair(d: Path) -> tuple[transformers.LlamaForCausalLM, CausalLM]:
    """Seed 0, save transformers' model under ``d``, load ours from it: (hf, ours)."""
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    hf = transformers.LlamaForCausalLM(hc).eval().float()
    hf.save_pretrained(d)
    ours = CausalLM.from_state_dict(load_config(d), load_weights(d, torch.float32),
                                            torch.float32, torch.device("cpu"))
    return hf, ours
