"""First half of the all-reduce of one row tile of a row-parallel output: publish this rank's partial sum
of the rows to every rank, and signal the exchange's event on every rank (it completes when all ranks
have pushed). Waits only for the local matmul tile that produced the slice.

On the GPU the rows go straight into each peer's symmetric exchange buffer (slot parity = a2 % 2: a rank
cannot be two row-parallel outputs ahead of a peer that still reads the older one), then a release
atomic bumps the event counter in each peer's memory."""
import triton
import triton.language as tl

from distmk.tasks.base import TaskKind


@triton.jit
def ar_push_gpu(a0, a1, a2, n, rank, partial, exchange_peers, H: tl.constexpr, B_PAD: tl.constexpr,
                WORLD: tl.constexpr, BLOCK_N: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    base = ((a2 % 2) * WORLD + rank) * B_PAD          # exchange is [2, WORLD, B_PAD, H] float32 on every rank
    for j in range(0, a1, BLOCK_N):
        cols = a0 + j + rn
        mask = (rb < n)[:, None] & (rn < a1 - j)[None, :]
        rows = tl.load(partial + rb[:, None] * H + cols[None, :], mask=mask, other=0.0)
        for p in tl.static_range(WORLD):
            peer = tl.load(exchange_peers + p).to(tl.pointer_type(tl.float32))
            tl.store(peer + (base + rb)[:, None] * H + cols[None, :], rows, mask=mask)


class ArPush(TaskKind):
    name = "ar_push"
    args = ("row0", "nrows", "slot")  # slot: which row-parallel output (2*layer for o_proj, 2*layer+1 for down)
    communicates = True
    signals_all_ranks = True
    gpu = ar_push_gpu

    def cost(self, shape, layer, a):
        return shape.batch * a[1] * 4 * (1 + shape.plan.tp)

    def run(self, ctx, layer, a):
        row0, nrows, _slot = a
        ctx.published[ctx.signal] = ctx.buf["partial"][:ctx.num_rows, row0:row0 + nrows].clone()
