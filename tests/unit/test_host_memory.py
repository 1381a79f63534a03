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
