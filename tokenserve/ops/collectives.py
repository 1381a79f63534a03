"""The collectives tensor parallelism needs, over a torch.distributed process group (gloo
on CPU, NCCL / HCCL where the device has it).

Two operations, both with a fixed reduction order so a row's result never depends on the
other rows of the message (batch invariance under tensor parallelism):

- :meth:`Collectives.all_reduce` sums fp32 partial results element by element. At two
  ranks the sum is ``a0 + a1`` whatever the algorithm (addition commutes); above two,
  gloo's ring cuts the message into chunks whose reduction order depends on the message
  size, so rows could differ with the batch: tensor parallelism is batch-invariant at
  ``world == 2`` by construction and the tests check exactly that.
- :meth:`Collectives.all_gather_cols` concatenates each rank's columns (the vocab-parallel
  logits), padded to the widest part on the wire.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("tokenserve.ops")


class Collectives:
    """Sum and gather over ``group`` (None: the default group).

    Args:
        rank, world: this rank and the group's size.
        widths: every rank's column count for :meth:`all_gather_cols` (the vocabulary
            split), in rank order.
    """

    def __init__(self, rank: int, world: int, widths: list[int], group=None) -> None:
        assert len(widths) == world and 0 <= rank < world
        self.rank, self.world, self.widths, self.group = rank, world, widths, group

    def all_reduce(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's ``x`` [..] summed in fp32, returned as ``dtype`` (one rounding).

        Raises:
            RuntimeError: a peer is gone (gloo's connection error).
        """
        y = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        dist.all_reduce(y, group=self.group)
        return y if dtype == torch.float32 else y.to(dtype)

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[R, widths[rank]] -> [R, sum(widths)]: every rank's columns in rank order."""
        width = max(self.widths)
        mine = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine.contiguous(), group=self.group)
        return torch.cat([p[:, :w] for p, w in zip(parts, self.widths)], dim=1)


#: the x86 memory model keeps stores in program order (TSO): a peer that sees a rank's
#: flag sees the data written before it; elsewhere the shared-memory path is not used
SHM_MACHINES = ("x86_64", "AMD64", "i686")
#: spins between yields of the core while waiting for peers (a rank per core spins; a
#: machine with more ranks than cores yields)
_SPINS = 64


class ShmCollectives(Collectives):
    """:class:`Collectives` for ranks on one host through a shared-memory segment: each
    rank writes its part into its own slot, publishes a sequence number, waits until every
    rank has published, and reads (a sum in rank order, or the concatenation). The sum's
    order is fixed whatever the message size, so tensor parallelism is batch-invariant at
    any number of ranks on this path.

    Layout (``slot_bytes`` per rank, two buffers by call parity so a rank that runs ahead
    never overwrites a part its peers are still reading)::

        int64 seq[world] | pad to 64 B | 2 x world x slot_bytes

    Args:
        path: the segment's file (``/dev/shm/...``); rank 0 creates it (``create``), the
            others open it once rank 0 has.
        slot_bytes: the largest message, bytes (fp32 rows x hidden; logits rows x vocab
            part); a larger one goes through gloo.

    Raises:
        OSError: the segment cannot be created (no room in /dev/shm) or opened.
    """

    def __init__(self, rank: int, world: int, widths: list[int], path: str, slot_bytes: int,
                 create: bool, group=None) -> None:
        import mmap
        import os

        import numpy as np

        super().__init__(rank, world, widths, group)
        self.slot_bytes = slot_bytes
        head = 64 * ((8 * world + 63) // 64)
        size = head + 2 * world * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # allocated now: a full /dev/shm fails here, not mid-step (SIGBUS)
                os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._seq = np.frombuffer(self._map, dtype=np.int64, count=world)
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=head,
                                      count=2 * world * slot_bytes).view(2, world, slot_bytes)
        self._calls = 0

    @classmethod
    def open_group(cls, rank: int, world: int, widths: list[int], path: str,
                   slot_bytes: int, group=None) -> ShmCollectives | None:
        """Open the segment on every rank of ``group`` (a collective: each rank calls it,
        after ``init_process_group``). Rank 0 creates it at ``path`` and broadcasts the
        path (the others' ``path`` is ignored); the others map it; once every rank has it
        mapped rank 0 unlinks it, so nothing is left in /dev/shm whatever happens later.

        Returns:
            this rank's collectives, or None on every rank when rank 0 could not create
            the segment (logged once there: the caller takes gloo's :class:`Collectives`).

        Raises:
            OSError: a rank > 0 cannot map the segment rank 0 created.
        """
        import os

        comm = None
        if rank == 0:
            try:
                comm = cls(rank, world, widths, path, slot_bytes, create=True, group=group)
            except OSError as exc:
                log.warning("tensor parallelism: no shared-memory segment (%s); gloo "
                            "instead", exc)
                path = ""
        box = [path]
        dist.broadcast_object_list(box, src=0, group=group)  # rank 0's path, or ""
        if not box[0]:
            return None
        if rank:
            comm = cls(rank, world, widths, box[0], slot_bytes, create=False, group=group)
        dist.barrier(group=group)  # every rank has it mapped
        if rank == 0:
            os.unlink(path)
        return comm

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish ``x`` (contiguous) and wait for every rank's; returns the buffer
        ``[world, slot_bytes]`` holding all parts."""
        import os

        self._calls += 1
        buf = self._data[self._calls & 1]
        n = x.numel() * x.element_size()
        buf[self.rank, :n].copy_(x.view(-1).view(torch.uint8))
        self._seq[self.rank] = self._calls
        spins = 0
        while self._seq.min() < self._calls:
            spins += 1
            if spins % _SPINS == 0:
                os.sched_yield()
        return buf

    def all_reduce(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        y = x.float().contiguous() if x.dtype != torch.float32 or not x.is_contiguous() else x
        n = y.numel() * 4
        if n > self.slot_bytes:
            return super().all_reduce(y, dtype)
        buf = self._exchange(y)
        parts = buf[:, :n].view(torch.float32).view(self.world, *y.shape)
        out = parts[0].clone()
        for r in range(1, self.world):  # rank order: the same sum on every rank
            out += parts[r]
        return out if dtype == torch.float32 else out.to(dtype)

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        width = max(self.widths)
        n = x.shape[0] * width * 4
        if n > self.slot_bytes or x.dtype != torch.float32:
            return super().all_gather_cols(x)
        mine = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        buf = self._exchange(mine.contiguous())
        parts = buf[:, :n].view(torch.float32).view(self.world, x.shape[0], width)
        return torch.cat([parts[r, :, :w] for r, w in enumerate(self.widths)], dim=1)
