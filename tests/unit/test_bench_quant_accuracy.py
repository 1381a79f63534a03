"""``bench/quant_accuracy.py``: the per-position KL / argmax helper and the llama.cpp row's
failure path (no model is loaded, nothing of llama.cpp is needed)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root holds bench/

from bench import quant_accuracy as qa


def test_kl_is_zero_for_the_same_distribution_and_ignores_a_logit_shift():
    ref = torch.randn(5, 17)
    kl, same = qa.kl_top1(ref, ref + 3.0)  # softmax is shift-invariant per row
    assert kl.dtype == torch.float64 and kl.shape == (5,)
    assert torch.allclose(kl, torch.zeros(5, dtype=torch.float64), atol=1e-12)
    assert bool(same.all())


def test_kl_matches_the_closed_form_and_argmax_flags():
    # two tokens: p = (0.75, 0.25), q = (0.25, 0.75)
    ref = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]], dtype=torch.float64)
    other = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]], dtype=torch.float64)
    kl, same = qa.kl_top1(ref, other)
    want = 0.75 * math.log(3.0) + 0.25 * math.log(1 / 3.0)
    assert kl[0].item() == pytest.approx(want, rel=1e-12)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-15)
    assert same.tolist() == [False, True]
    assert (kl >= 0).all()


def test_kl_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        qa.kl_top1(torch.zeros(3, 10), torch.zeros(3, 11))


def test_llamacpp_lib_dir_without_the_library_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="libllama.so"):
        qa.llamacpp_logits(tmp_path / "x.gguf", 64, 2, str(tmp_path))
