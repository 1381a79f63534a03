"""Large host (CPU) buffers on transparent huge pages.

The KV cache is one region of ~1 GiB read at scattered blocks every decode step; on 4 KB
pages each block is a few page-table walks the hardware prefetchers do not cross. Linux's
transparent huge pages in ``madvise`` mode (the common default: ``/sys/kernel/mm/
transparent_hugepage/enabled``) back only regions that ask for them with
``madvise(MADV_HUGEPAGE)`` (``man 2 madvise``), which a ``torch.zeros`` allocation does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes (x86-64 PMD size)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype,
                        touch: bool = True) -> torch.Tensor:
    """A zeroed contiguous CPU tensor on 2 MiB-aligned anonymous memory advised for huge pages.

    Args:
        shape: the tensor's shape (elements).
        dtype: its dtype.
        touch: fault every page in now (False: each page becomes resident when first
            written, so filling the region piece by piece never holds it all at once).

    Returns:
        the tensor (not a view: ``._base`` is None), with ``touch`` every page touched
        (resident, like ``torch.zeros``); its storage keeps the mapping alive. Where ``mmap.MADV_HUGEPAGE``
        does not exist (not Linux) or the kernel refuses the advice, the same zeroed memory
        on normal pages. Batch results do not depend on it: only where the bytes live.

    Raises:
        ValueError: a negative dimension.
    """
    if any(int(s) < 0 for s in shape):
        raise ValueError(f"negative dimension in {tuple(shape)}")
    itemsize = dtype.itemsize
    nbytes = torch.Size(shape).numel() * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            region.madvise(advice)
        except OSError:  # THP off in this kernel: normal pages
            pass
    storage = torch.frombuffer(region, dtype=torch.uint8).untyped_storage()  # owns the mapping
    start = (-storage.data_ptr()) % HUGE_PAGE
    # a tensor of its own on the storage (not a view: callers such as the C++ decoder find
    # the region of their views through ._base)
    t = torch.empty(0, dtype=dtype).set_(storage, start // itemsize, tuple(shape),
                                         torch.empty(tuple(shape), device="meta").stride())
    if touch:
        t.zero_()  # fault every page in now (anonymous memory reads as zero already)
    return t


def on_one_huge_region(shapes: list[tuple[tuple[int, ...], torch.dtype]],
                       align: int = 64) -> list[torch.Tensor]:
    """Zeroed contiguous tensors of these shapes and dtypes side by side, in the order given,
    in one region on huge pages (each at an ``align``-byte boundary): views of one tensor of
    :func:`zeros_on_huge_pages` made with ``touch=False``, so a page becomes resident when
    it is first written (a caller moving tensors in one at a time, each original freed
    after its copy, never holds two copies of more than one).

    Args:
        shapes: ``(shape, dtype)`` per tensor.
        align: bytes (a multiple of every dtype's size; 64: a cache line).

    Raises:
        ValueError: a negative dimension, or ``align`` not a multiple of a dtype's size.
    """
    offsets, total = [], 0
    for shape, dtype in shapes:
        if any(int(d) < 0 for d in shape):
            raise ValueError(f"negative dimension in {tuple(shape)}")
        if align % dtype.itemsize:
            raise ValueError(f"align={align} is not a multiple of {dtype}'s size")
        offsets.append(total)
        total += -(-torch.Size(shape).numel() * dtype.itemsize // align) * align
    region = zeros_on_huge_pages((total,), torch.uint8, touch=False)
    return [region[off:off + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), off in zip(shapes, offsets)]



#: Weights from this size up are moved onto huge pages (:func:`weight_on_huge_pages`): the
#: partly used last 2 MiB page wastes under 2 MiB, at most a fifth of such a tensor.
HUGE_WEIGHT_MIN_BYTES = 8 << 20


def weight_on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A packed weight of ``HUGE_WEIGHT_MIN_BYTES`` or more copied onto huge pages
    (:func:`zeros_on_huge_pages`); smaller, non-contiguous or non-CPU tensors as they are.

    A batch-1 step streams every weight from DRAM once; on 4 KiB pages the hardware
    prefetchers stop at each page boundary. Measured on Zen 4 (2 threads, Llama-3.2-1B
    shapes, 6 copies of each weight, best of 5): gate_up [16384, 2048] Q4_K 32.8 -> 36.2
    GB/s, Q6_K 28.7 -> 32.9, down [2048, 8192] Q4_K 37.4 -> 39.2, Q6_K 30.9 -> 34.8; the
    2-4 MB tensors (in cache there) unchanged. Same bytes, so the same results.
    """
    if (t.device.type != "cpu" or not t.is_contiguous()
            or t.numel() * t.element_size() < HUGE_WEIGHT_MIN_BYTES):
        return t
    h = zeros_on_huge_pages(tuple(t.shape), t.dtype)
    h.copy_(t)
    return h


_MADV_DONTNEED = 4  # asm-generic/mman-common.h


def file_backed(addr: int) -> bool:
    """True when ``addr`` lies in a file-backed mapping of this process
    (``/proc/self/maps``: a non-zero inode)."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                if lo <= addr < hi:
                    return fields[4] != "0"
    except (OSError, ValueError, IndexError):
        pass
    return False


def drop_file_pages(t: torch.Tensor) -> int:
    """Unmap from this process the pages of a tensor that views a file mapping (a GGUF's
    blocks read through ``mmap``), once its bytes have been packed elsewhere: they leave the
    process's resident set and a later read faults them back in from the file, so nothing
    can be lost (``madvise(MADV_DONTNEED)`` on a file mapping we never wrote). Anonymous
    memory is left alone. Only whole pages inside the tensor are dropped.

    Without it a load holds every mapped source page beside its packed copy until the end:
    peak resident 2x the weights (Llama-3.2-1B-shaped Q6_K file: 2668 MiB vs llama-server's
    1230).

    Returns:
        Bytes dropped (0 where nothing was file-backed, or not Linux).
    """
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
        return 0
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, (start + nbytes) // page * page
    if hi <= lo or not file_backed(start):
        return 0
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        if libc.madvise(lo, hi - lo, _MADV_DONTNEED) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return hi - lo

def trim_heap() -> None:
    """Return the C heap's free memory to the OS now (glibc's ``malloc_trim(0)``): blocks
    under the mmap threshold freed by a load step stay in glibc's arena otherwise. A no-op
    where glibc is not the C library."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_rss(pid: int | str = "self") -> tuple[int, int] | None:
    """(resident bytes now, peak resident bytes) of a process (this one by default), from
    ``/proc/PID/status`` (``VmRSS``, ``VmHWM``); None where that file cannot be read (the
    process is gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        return None


#: glibc's mallopt parameter (malloc.h) and the thresholds used around a model load (bytes).
_M_MMAP_THRESHOLD = -3
_LOAD_MMAP_THRESHOLD = 1 << 20
_SERVE_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


@contextlib.contextmanager
def returned_to_os_after_load():
    """Around a model load: heap blocks of 1 MiB and more are mmapped (so the packing's
    temporaries go back to the OS when freed instead of staying in glibc's arena), then the
    threshold goes to 32 MiB (a step's activations reuse heap memory, no page faults per
    step) and ``malloc_trim`` returns what is left free. Measured on a Llama-3.2-1B-shaped
    Q4_K_M file: resident after the load 1425 -> 1010 MiB, peak 2458 -> 2121 MiB (763 MiB
    of packed weights). A no-op where glibc is not the C library."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _SERVE_MMAP_THRESHOLD)
        trim_heap()
