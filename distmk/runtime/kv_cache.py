"""Paged KV cache: fixed-size blocks in one pool per rank, and the allocator that hands them out.

Position p of a sequence lives in block block_table[p // block_size] at offset p % block_size, so
sequences grow without copying and a finished sequence returns its blocks at once."""
from __future__ import annotations

import torch

from distmk.errors import DistmkError


class KVCache:
    """Room for `max_seqs` sequences of up to `blocks_per_seq` blocks each (the block-table width)."""

    def __init__(self, num_layers: int, max_seqs: int, blocks_per_seq: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype, device):
        num_blocks = max_seqs * blocks_per_seq
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.num_blocks, self.blocks_per_seq = block_size, num_blocks, blocks_per_seq
        self.free = list(range(num_blocks - 1, -1, -1))
        self.rope = None    # the kernels' RoPE table of the positions it holds (tasks/base.py rope_table): the first
                            # executor builds it, the engine's others share it

    def allocate(self, blocks: list[int], length: int) -> list[int]:
        """Grow a sequence's block list so that it holds `length` positions."""
        need = -(-length // self.block_size) - len(blocks)
        if need > len(self.free):
            raise DistmkError(f"KV cache is full: {need} more block(s) of {self.block_size} needed, "
                              f"{len(self.free)} free of {self.num_blocks}")
        return blocks + [self.free.pop() for _ in range(max(0, need))]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))
