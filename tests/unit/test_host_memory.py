"""tokenserve.ops.host_memory: the KV cache region on transparent huge pages."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from tokenserve.ops.host_memory import HUGE_PAGE, zeros_on_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", text).group(1))


def test_zeroed_contiguous_aligned_and_writable():
    t = zeros_on_huge_pages((3, 2, 5, 7), torch.bfloat16)
    assert t.shape == (3, 2, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0 and t._base is None
    assert not t.float().abs().sum()
    t[1, 1] = 2.5
    view = t[1]
    del t
    gc.collect()
    assert float(view[1].float().mean()) == 2.5  # a view keeps the mapping alive


def test_empty_and_bad_shape():
    assert zeros_on_huge_pages((0, 4), torch.float32).shape == (0, 4)
    with pytest.raises(ValueError):
        zeros_on_huge_pages((2, -1), torch.float32)


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="transparent huge pages off in this kernel")
def test_backed_by_huge_pages_where_the_kernel_has_them():
    """THP in madvise or always mode: 16 MiB come back as huge pages (AnonHugePages)."""
    before = _anon_huge_kb()
    t = zeros_on_huge_pages((8, HUGE_PAGE // 4), torch.float32)
    assert _anon_huge_kb() - before >= 8 * 1024
    del t


def test_llama_kv_cache_on_huge_pages():
    """allocate_kv_cache's region on the CPU comes from zeros_on_huge_pages (2 MiB aligned,
    layers then K/V contiguous)."""
    from tokenserve.models.decoder import CausalLM

    class Model:
        device = torch.device("cpu")
        dtype = torch.bfloat16
        num_layers = 2

        class cfg:
            num_kv_heads, head_dim = 3, 64

        kv_row_elements = CausalLM.kv_row_elements

    caches = CausalLM.allocate_kv_cache(Model(), 4, 16)
    k0, v1 = caches[0][0], caches[1][1]
    assert k0.shape == (4, 3, 16, 64) and k0.data_ptr() % HUGE_PAGE == 0
    assert v1.data_ptr() - k0.data_ptr() == 3 * 4 * 3 * 16 * 64 * 2
    assert not k0.float().abs().sum()
    # an int8 cache: rows of head_dim values and a 4-byte scale
    caches = CausalLM.allocate_kv_cache(Model(), 4, 16, torch.int8)
    k0, v1 = caches[0][0], caches[1][1]
    assert k0.shape == (4, 3, 16, 68) and k0.dtype == torch.int8
    assert k0.data_ptr() % HUGE_PAGE == 0 and v1.data_ptr() - k0.data_ptr() == 3 * 4 * 3 * 16 * 68


def test_large_packed_weights_move_to_huge_pages_small_ones_stay():
    """weight_on_huge_pages: a copy with the same bytes on 2 MiB-aligned memory from
    HUGE_WEIGHT_MIN_BYTES on; smaller, non-contiguous tensors are returned as they are."""
    from tokenserve.ops.host_memory import HUGE_WEIGHT_MIN_BYTES, weight_on_huge_pages

    big = torch.randint(0, 256, (HUGE_WEIGHT_MIN_BYTES // 64, 64), dtype=torch.uint8)
    moved = weight_on_huge_pages(big)
    assert moved.data_ptr() % HUGE_PAGE == 0 and torch.equal(moved, big)
    small = torch.randn(4, 8)
    assert weight_on_huge_pages(small) is small
    strided = big.t()
    assert weight_on_huge_pages(strided) is strided


def test_linear_keeps_a_large_quantised_weight_on_huge_pages():
    """Linear's packed GGUF blocks (here k-quants, 16384 x 2048 Q4_K: 18 MiB) land on huge
    pages; the GEMM's results are those of the same blocks elsewhere."""
    from tests.unit.test_kernel_quant_k import HAVE_C, _gemm, _weight
    from tokenserve.ops.linear import Linear

    if not HAVE_C:
        pytest.skip("tokenserve._C not built")
    qw = _weight(16384, 2048, "q4_k")
    lin = Linear(qw, out_dtype=torch.float32)
    assert lin.qweight.data.data_ptr() % HUGE_PAGE == 0
    x = torch.randn(3, 2048)
    assert torch.equal(lin(x), _gemm(x, qw))


def test_on_one_huge_region_lays_tensors_side_by_side_untouched():
    """on_one_huge_region: zeroed views of one 2 MiB-aligned tensor, in order, each at a
    64-byte boundary; its pages are not resident until written."""
    from tokenserve.ops.host_memory import on_one_huge_region, process_rss

    shapes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((0, 4), torch.uint8),
              ((64 << 20,), torch.uint8)]
    rss0 = process_rss()[0]
    views = on_one_huge_region(shapes)
    assert process_rss()[0] - rss0 < (16 << 20)  # 64 MiB mapped, not faulted in
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views if v.numel())
    assert all(v.is_contiguous() for v in views)
    assert views[0].data_ptr() % HUGE_PAGE == 0
    assert [(tuple(v.shape), v.dtype) for v in views] == shapes
    offsets = [views[i].data_ptr() - views[0].data_ptr() for i in (0, 1, 3)]
    assert offsets == [0, 64, 128]  # 60 bytes -> 64, 14 -> 64, the empty one 0
    assert not any(v.float().abs().sum() for v in views[:3])
    views[0].fill_(1.0)
    views[1].fill_(2.0)
    assert float(views[0].sum()) == 15.0 and float(views[1].float().sum()) == 14.0
    with pytest.raises(ValueError):
        on_one_huge_region([((2, -1), torch.float32)])
    with pytest.raises(ValueError):
        on_one_huge_region([((2,), torch.float32)], align=2)


def test_colocate_moves_small_packed_weights_and_keeps_results():
    """colocate_on_huge_pages: the small packed weights (Q4_K and bf16 panels) of a list of
    projections end up side by side on one huge-page region, in order; a large one (on
    huge pages of its own already) and the torch backend stay; every GEMM gives the same
    bits as before."""
    from tests.unit.test_kernel_quant_k import HAVE_C, _weight
    from tokenserve.ops.linear import Linear, SplitLinear, colocate_on_huge_pages

    if not HAVE_C:
        pytest.skip("tokenserve._C not built")
    g = torch.Generator().manual_seed(0)
    lins = [Linear(_weight(1024, 2048, "q4_k"), out_dtype=torch.float32),
            SplitLinear([Linear(_weight(512, 2048, "q4_k")), Linear(_weight(256, 2048, "q6_k"))]),
            Linear(torch.randn(1024, 2048, generator=g).bfloat16()),
            Linear(_weight(16384, 2048, "q4_k"), out_dtype=torch.float32)]
    x = torch.randn(5, 2048, generator=g)
    want = [lin(x) for lin in lins]
    big = lins[3].packed
    small = [lins[0], *lins[1].parts, lins[2]]
    nbytes = sum(lin.packed.numel() * lin.packed.element_size() for lin in small)
    assert colocate_on_huge_pages(lins) == nbytes
    base = small[0].packed.untyped_storage().data_ptr()
    assert all(lin.packed.untyped_storage().data_ptr() == base for lin in small)
    ptrs = [lin.packed.data_ptr() for lin in small]
    assert ptrs == sorted(ptrs) and ptrs[0] % HUGE_PAGE == 0
    assert lins[3].packed is big
    assert all(torch.equal(lin(x), w) for lin, w in zip(lins, want))
    # under one huge page's worth in all: nothing moves
    tiny = [Linear(_weight(64, 256, "q4_k"))]
    before = tiny[0].packed
    assert colocate_on_huge_pages(tiny) == 0 and tiny[0].packed is before


def test_returned_to_os_after_load_restores_and_trims():
    """The load context runs its body and leaves (glibc: threshold pinned, then trimmed)."""
    from tokenserve.ops.host_memory import process_rss, returned_to_os_after_load

    with returned_to_os_after_load():
        t = torch.ones(4 << 20)
        del t
    rss = process_rss()
    assert rss is None or (rss[0] > 0 and rss[1] >= rss[0])


def test_drop_file_pages_releases_a_mapped_files_pages_and_keeps_its_bytes(tmp_path):
    """A tensor viewing a mapped file (as a GGUF's blocks are) leaves the resident set once
    dropped, and reads back the file's bytes; anonymous memory is never touched."""
    import mmap as _mmap

    from tokenserve.ops.host_memory import drop_file_pages, process_rss

    data = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.numpy().tobytes())
    import numpy as np

    view = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))  # private, not written
    assert torch.equal(view, data)  # every page touched: resident
    before = process_rss()
    dropped = drop_file_pages(view)
    assert dropped >= (32 << 20) - 2 * _mmap.PAGESIZE
    after = process_rss()
    if before is not None:
        assert after[0] <= before[0] - (16 << 20)
    assert torch.equal(view, data)  # faulted back in from the file
    anon = data.clone()
    assert drop_file_pages(anon) == 0 and torch.equal(anon, data)
