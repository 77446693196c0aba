"""Second half of the all-reduce of one row tile: once every rank's partial of the rows has arrived (the
push event completes with one signal per rank), x[:, rows] += their sum, taken in rank order so that all
ranks hold bit-identical results. The exchange layout is ar_push's."""
import triton
import triton.language as tl

from distmk.comm import sum_in_rank_order
from distmk.tasks.ar_push import exchange_region
from distmk.tasks.base import TaskKind


@triton.jit
def allreduce_gpu(row0, nrows, slot, n, x, exchange, H: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr,
                  EXCHANGE_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    for j in range(0, nrows, BLOCK_N):
        cols = j + rn
        mask = (rb < n)[:, None] & (cols < nrows)[None, :]
        total = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
        for src in tl.static_range(WORLD):
            region = exchange_region(row0, slot, src, H, B_PAD, WORLD, EXCHANGE_SLOTS)
            total += tl.load(exchange + region + rb[:, None] * nrows + cols[None, :], mask=mask, other=0.0)
        offs = rb[:, None] * H + (row0 + cols)[None, :]
        residual = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x + offs, (residual + total).to(x.dtype.element_ty), mask=mask)


class AllReduce(TaskKind):
    name = "allreduce"
    args = ("row0", "nrows", "slot")
    communicates = True
    gpu = allreduce_gpu

    def cost(self, shape, layer, a):
        return shape.batch * a[1] * (4 * shape.plan.tp + 8)

    def run(self, ctx, layer, a):
        row0, nrows, _slot = a
        n, x = ctx.num_rows, ctx.buf["x"]
        total = sum_in_rank_order(ctx.comm, ctx.published.pop(ctx.wait))
        x[:n, row0:row0 + nrows] = (x[:n, row0:row0 + nrows].float() + total).to(x.dtype)
