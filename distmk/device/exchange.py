"""The row-parallel all-reduce's exchange, tl side: where a rank's partial sum of a row tile goes, and its push.

The exchange buffers are symmetric, [EXCHANGE_SLOTS, WORLD, B_PAD * H] float32 on every rank: slot
`output % EXCHANGE_SLOTS` (output: which row-parallel output of the step, 2l for layer l's o_proj, 2l + 1 for its
MLP; 2 slots in the megakernel: a rank cannot be two outputs ahead of a peer that still reads the older one), then
the source rank, then the tile's rows packed contiguously ([n, nrows] at offset row0 * B_PAD), so one put moves a
tile. The tile that computes the partial pushes it from its registers (push_block), then signals the exchange's
event on every rank (push_signal): it completes when every rank has pushed, and the allreduce task of the tile
(tasks/allreduce.py) sums the ranks' partials. Two transports (TRANSPORT): 0 stores straight into each peer's
buffer through its address (nvshmem_ptr; one node) and bumps the peer's event counter with a system-scope release
atomic; 1 stores into its own slot, then NVSHMEM put-with-signal copies it to each peer and adds 1 to the peer's
counter (works across nodes).
"""
import triton
import triton.language as tl

from distmk.device.nvshmem import putmem_signal_block
from distmk.device.primitives import signal_all_ranks


@triton.jit
def exchange_region(row0, output, src, H: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr,
                    EXCHANGE_SLOTS: tl.constexpr):
    """Offset of rank src's packed rows [row0, row0 + nrows) of row-parallel output `output` in the exchange."""
    return ((output % EXCHANGE_SLOTS) * WORLD + src).to(tl.int64) * B_PAD * H + row0 * B_PAD


@triton.jit
def push_block(values, rb, cols, mask, region, nrows, exchange, exchange_peers, WORLD: tl.constexpr,
               TRANSPORT: tl.constexpr):
    """A block of this rank's partial sum of a tile (float32 values [B_PAD, BLOCK] of rows rb and of the tile's
    columns `cols`, 0-based) into every rank's exchange at `region` (TRANSPORT 0), or into this rank's own (1:
    push_signal puts it)."""
    packed = region + rb[:, None] * nrows + cols[None, :]
    if TRANSPORT == 0:
        for p in tl.static_range(WORLD):
            peer = tl.load(exchange_peers + p).to(tl.pointer_type(tl.float32))
            tl.store(peer + packed, values, mask=mask)
    else:
        tl.store(exchange + packed, values, mask=mask)


@triton.jit
def push_signal(region, n, nrows, rank, signal, exchange, counters, counter_peers, WORLD: tl.constexpr,
                TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr):
    """After a tile's push_blocks: event `signal` bumped on every rank, the tile's rows put first (TRANSPORT 1)."""
    if TRANSPORT == 0:
        signal_all_ranks(counter_peers, signal, WORLD)
    else:
        tl.debug_barrier()              # the whole tile is in our slot before the CTA puts it
        src = (exchange + region).to(tl.int64)
        for p in tl.static_range(WORLD):
            if p != rank:
                putmem_signal_block(src, src, (n * nrows * 4).to(tl.int64), (counters + signal).to(tl.int64),
                                    tl.full((), 1, tl.uint64), SIGNAL_ADD, p)
        tl.atomic_add(counters + signal, 1, sem="release", scope="sys")
