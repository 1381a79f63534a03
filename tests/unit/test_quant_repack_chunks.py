"""The k8 regrouping of k-quant weights at load.

``repack_k8`` (torch) runs in pieces of ~2M weights (bounded transient memory: a 128256-row
Q6_K table peaked at ~6 GB in one piece, 4096-row pieces still put ~300 MiB on a 1B model's
peak): the pieces give exactly the one-piece bytes, and the inverse gives the file's rows
back. ``csrc/quant_k_pack.cpp`` (what a load runs where the extension is built) gives the
same bytes in one pass."""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_kernel_quant_k import _weight
from tokenserve.ops import quant_blocks
from tokenserve.ops.dispatch import load_kernels
from tokenserve.ops.quant import repack_x8
from tokenserve.ops.quant_blocks import QTYPE_IDS, repack_k8, unpack_k8


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("n", [8, 37, 64])
def test_repack_in_pieces_equals_one_piece(monkeypatch, qtype, n):
    w = _weight(n, 512, qtype, seed=n)
    whole = repack_k8(w)
    monkeypatch.setattr(quant_blocks, "_REPACK_WEIGHTS", 16 * 512)  # 16 rows a piece
    pieces = repack_k8(w)
    assert pieces.shape == whole.shape and pieces.layout == "k8"
    assert torch.equal(pieces.data, whole.data)
    assert torch.equal(unpack_k8(pieces).data, w.data)


C = load_kernels()
needs_repack = pytest.mark.skipif(C is None or not hasattr(C, "repack_k8"),
                                  reason="tokenserve._C (repack_k8) not built")


@needs_repack
@pytest.mark.parametrize("qtype", ["q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("n,k", [(1, 256), (8, 512), (37, 768), (64, 256)])
def test_cpp_repack_equals_torch(qtype, n, k):
    """csrc/quant_k_pack.cpp's one-pass regrouping gives repack_k8's bytes (rows past N
    zero), and the loaders' entry point (repack_x8 with the extension) takes it."""
    w = _weight(n, k, qtype, seed=3 * n + k)
    ref = repack_k8(w)
    got = C.repack_k8(w.data, QTYPE_IDS[qtype], k)
    assert got.shape == ref.data.shape and got.dtype == torch.uint8
    assert torch.equal(got, ref.data)
    via = repack_x8(w, C)
    assert via.layout == "k8" and via.shape == w.shape and torch.equal(via.data, ref.data)
    assert torch.equal(unpack_k8(via).data, w.data)


@needs_repack
def test_cpp_repack_rejects_bad_input():
    w = _weight(8, 256, "q4_k")
    with pytest.raises(RuntimeError, match="qtype"):
        C.repack_k8(w.data, 2, 256)  # Q8_0 is no k-quant
    with pytest.raises(RuntimeError, match="K"):
        C.repack_k8(w.data, 12, 300)
    with pytest.raises(RuntimeError, match="bytes"):
        C.repack_k8(w.data, 12, 512)  # the rows hold one super-block, not two
    with pytest.raises(RuntimeError, match="contiguous"):
        C.repack_k8(w.data.t(), 12, 256)
