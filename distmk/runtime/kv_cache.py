"""Paged KV cache: fixed-size blocks in one pool per rank, the allocator that hands them out, and the prefix cache
that lets a sequence start from blocks another one already wrote.

Position p of a sequence lives in block block_table[p // block_size] at offset p % block_size, so
sequences grow without copying and a finished sequence returns its blocks at once.

A full block is known by a hash of its tokens and of every token before it (vLLM's block hashing, sha256: a
collision would hand one request another's keys), so a block's hash names the whole prefix it ends. Blocks are
counted by reference: a block whose last sequence left stays cached and is taken back, least recently used
first, only when no never-cached block is free."""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np
import torch

from distmk.errors import DistmkError


def block_hashes(tokens, block_size: int, parent: bytes = b"", start: int = 0) -> list[bytes]:
    """The hashes of the full blocks of `tokens` from block `start` on, chained from `parent` (the hash of
    block start - 1, b"" for the first)."""
    hashes = []
    for b in range(start, len(tokens) // block_size):
        block = np.asarray(tokens[b * block_size:(b + 1) * block_size], dtype=np.int64)
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        hashes.append(parent)
    return hashes


class KVCache:
    """Room for `max_seqs` sequences of up to `blocks_per_seq` blocks each (the block-table width)."""

    def __init__(self, num_layers: int, max_seqs: int, blocks_per_seq: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype, device):
        num_blocks = max_seqs * blocks_per_seq
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.num_blocks, self.blocks_per_seq = block_size, num_blocks, blocks_per_seq
        self.free = list(range(num_blocks - 1, -1, -1))     # never written, or written and not cached
        self.refs = [0] * num_blocks                        # sequences holding each block
        self.cached: dict[bytes, int] = {}                  # block hash -> the block that holds it
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()     # cached blocks no sequence holds, oldest first
        self.rope = None    # the kernels' RoPE table of the positions it holds (tasks/base.py rope_table): the first
                            # executor builds it, the engine's others share it

    @property
    def available(self) -> int:
        """Blocks an allocation may take: the free ones and the cached ones no sequence holds."""
        return len(self.free) + len(self.evictable)

    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (the block hashes of a sequence's tokens)."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def allocate(self, blocks: list[int], length: int) -> list[int]:
        """Grow a sequence's block list so that it holds `length` positions."""
        need = -(-length // self.block_size) - len(blocks)
        if need > self.available:
            raise DistmkError(f"KV cache is full: {need} more block(s) of {self.block_size} needed, "
                              f"{self.available} free of {self.num_blocks}")
        new = []
        for _ in range(max(0, need)):
            if self.free:
                block = self.free.pop()
            else:                               # the least recently used cached block is forgotten
                block, _ = self.evictable.popitem(last=False)
                del self.cached[self.hash_of.pop(block)]
            self.refs[block] = 1
            new.append(block)
        return blocks + new

    def share(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (found by match) for a sequence that starts from them."""
        for block in blocks:
            self.refs[block] += 1
            self.evictable.pop(block, None)

    def register(self, block: int, block_hash: bytes) -> None:
        """Record that a full block holds the tokens `block_hash` names. Another block holding the same prefix
        stays the one found (this one is freed as uncached when its sequences leave)."""
        if block not in self.hash_of and block_hash not in self.cached:
            self.cached[block_hash], self.hash_of[block] = block, block_hash

    def release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):     # a sequence's last blocks are the least likely to be asked for again
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)
