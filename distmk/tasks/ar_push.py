"""First half of the all-reduce of one row tile of a row-parallel output: publish this rank's partial sum
of the rows to every rank, and signal the exchange's event on every rank (it completes when all ranks
have pushed). Waits only for the local matmul tile that produced the slice.

Exchange buffers are symmetric, [EXCHANGE_SLOTS, WORLD, B_PAD * H] float32 on every rank: slot a2 %
EXCHANGE_SLOTS (2 in the megakernel: a rank cannot be two row-parallel outputs ahead of a peer that still
reads the older one), then the source rank,
then the tile's rows packed contiguously ([n, nrows] at offset row0 * B_PAD), so one put moves a tile.
Two transports (TRANSPORT): 0 stores straight into each peer's buffer through its address (nvshmem_ptr;
one node) and bumps the peer's event counter with a system-scope release atomic; 1 writes its own slot,
then NVSHMEM put-with-signal copies it to each peer and adds 1 to the peer's counter (works across nodes).
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.nvshmem import putmem_signal_block
from distmk.device.primitives import signal_all_ranks
from distmk.tasks.base import TaskKind


@triton.jit
def exchange_region(row0, slot, src, H: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr,
                    EXCHANGE_SLOTS: tl.constexpr):
    """Offset of rank src's packed rows [row0, row0 + nrows) of row-parallel output slot in the exchange."""
    return ((slot % EXCHANGE_SLOTS) * WORLD + src).to(tl.int64) * B_PAD * H + row0 * B_PAD


@triton.jit
def ar_push_gpu(row0, nrows, slot, n, rank, signal, partial, exchange, exchange_peers, counters, counter_peers,
                H: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr, EXCHANGE_SLOTS: tl.constexpr,
                BLOCK_N: tl.constexpr, TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    region = exchange_region(row0, slot, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS)
    for j in range(0, nrows, BLOCK_N):
        cols = j + rn
        mask = (rb < n)[:, None] & (cols < nrows)[None, :]
        rows = tl.load(partial + rb[:, None] * H + (row0 + cols)[None, :], mask=mask, other=0.0)
        packed = region + rb[:, None] * nrows + cols[None, :]
        if TRANSPORT == 0:
            for p in tl.static_range(WORLD):
                peer = tl.load(exchange_peers + p).to(tl.pointer_type(tl.float32))
                tl.store(peer + packed, rows, mask=mask)
        else:
            tl.store(exchange + packed, rows, mask=mask)
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


@gluon.jit
def exchange_region_ring(row0, slot, src, H: gl.constexpr, B_PAD: gl.constexpr, WORLD: gl.constexpr,
                         EXCHANGE_SLOTS: gl.constexpr):
    """exchange_region in Gluon."""
    return ((slot % EXCHANGE_SLOTS) * WORLD + src).to(gl.int64) * B_PAD * H + row0 * B_PAD


@gluon.constexpr_function
def exchange_layout(num_warps):
    """A tile's rows of the exchange: the batch down the warps, a warp across the columns."""
    return gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])


@gluon.jit
def ar_push_ring(row0, nrows, slot, n, rank, signal, partial, exchange_peers, counter_peers, H: gl.constexpr,
                 B_PAD: gl.constexpr, WORLD: gl.constexpr, EXCHANGE_SLOTS: gl.constexpr, O_PROJ_ROWS: gl.constexpr,
                 SYSTEM_SCOPE: gl.constexpr, num_warps: gl.constexpr):
    """ar_push_gpu's pointer transport (TRANSPORT 0) in Gluon, for the ring: the tile's partial rows stored into
    every rank's exchange, then the event bumped on every rank (NVSHMEM's put-with-signal stays on the tl kernel)."""
    CP: gl.constexpr = rg.next_power_of_2(O_PROJ_ROWS)
    layout: gl.constexpr = exchange_layout(num_warps)
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(1, layout))
    rc = gl.arange(0, CP, layout=gl.SliceLayout(0, layout))
    region = exchange_region_ring(row0, slot, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS)
    for j in range(0, nrows, CP):
        cols = j + rc
        mask = (rb < n)[:, None] & (cols < nrows)[None, :]
        rows = gl.load(partial + rb[:, None] * H + (row0 + cols)[None, :], mask=mask, other=0.0)
        packed = region + rb[:, None] * nrows + cols[None, :]
        for p in gl.static_range(WORLD):
            gl.store(rg.peer_pointer(exchange_peers, p, gl.float32) + packed, rows, mask=mask)
    rg.signal_all_ranks(counter_peers, signal, WORLD, SYSTEM_SCOPE, num_warps)


class ArPush(TaskKind):
    name = "ar_push"
    args = ("row0", "nrows", "slot")  # slot: which row-parallel output (2*layer for o_proj, 2*layer+1 for down)
    communicates = True
    signals_all_ranks = True
    gpu = ar_push_gpu
    ring = ar_push_ring

    def cost(self, shape, layer, a):
        return shape.batch * a[1] * 4 * (1 + shape.plan.tp)

    def run(self, ctx, layer, a):
        row0, nrows, _slot = a
        ctx.published[ctx.signal] = ctx.buf["partial"][:ctx.num_rows, row0:row0 + nrows].clone()
