"""Pure-torch reference implementations of the block-table ops.

Each function is the oracle a C++ kernel in ``csrc/`` is tested against (a later issue
adds the kernels); the engine calls these when the extension is absent.
Slot of position ``p`` under block table ``bt``: ``bt[p // block_size] * block_size +
p % block_size`` (see ``tokenserve/models/attention.py``).
"""

from __future__ import annotations

import torch


def pad_block_tables(tables: list[list[int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Ragged block tables -> [B, max_blocks] int64, padded with block 0."""
    width = max((len(t) for t in tables), default=0)
    out = torch.zeros((len(tables), max(width, 1)), dtype=torch.int64)
    for i, t in enumerate(tables):
        if t:
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    return out.to(device)


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor,
                 seq_index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each token.

    Args:
        block_tables: [B, max_blocks] int64.
        positions: [T] int64 absolute position of each token.
        seq_index: [T] int64 row of ``block_tables`` each token belongs to.
        block_size: tokens per block.

    Returns:
        [T] int64 flattened cache slots.
    """
    blocks = block_tables[seq_index, positions // block_size]
    return blocks * block_size + positions % block_size


def context_slots(block_tables: torch.Tensor, ctx_lens: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of every context position of each sequence, padded to the longest.

    Args:
        block_tables: [B, max_blocks] int64.
        ctx_lens: [B] int64 context lengths (tokens), each <= max_blocks * block_size.
        block_size: tokens per block.

    Returns:
        (slots [B, L] int64 with padding slots = block_tables[:, 0]'s first slot,
         mask [B, L] bool, True for real positions), L = max(ctx_lens).
    """
    L = int(ctx_lens.max()) if ctx_lens.numel() else 0
    pos = torch.arange(L, device=block_tables.device)
    blk = block_tables[:, pos // block_size]
    slots = blk * block_size + pos % block_size
    mask = pos[None, :] < ctx_lens[:, None]
    return torch.where(mask, slots, torch.zeros_like(slots)), mask
