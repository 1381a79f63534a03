"""``repack_k8`` of a large k-quant weight runs in row-group pieces (bounded transient
memory at load: a 128256-row Q6_K table peaked at ~6 GB in one piece, ~1.2 GB in pieces):
the pieces give exactly the one-piece bytes, and the inverse gives the file's rows back."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_kernel_quant_k import _weight
from tokenserve.ops import quant_blocks
from tokenserve.ops.quant_blocks import repack_k8, unpack_k8


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("n", [8, 37, 64])
def test_repack_in_pieces_equals_one_piece(monkeypatch, qtype, n):
    w = _weight(n, 512, qtype, seed=n)
    whole = repack_k8(w)
    monkeypatch.setattr(quant_blocks, "_REPACK_GROUPS", 2)  # 16 rows a piece
    pieces = repack_k8(w)
    assert pieces.shape == whole.shape and pieces.layout == "k8"
    assert torch.equal(pieces.data, whole.data)
    assert torch.equal(unpack_k8(pieces).data, w.data)
