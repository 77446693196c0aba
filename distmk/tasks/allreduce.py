"""The all-reduce of one row tile of a row-parallel output, after every rank's tile pushed its partial sum of the
rows (device/exchange.py: the push event completes with one signal per rank): x[:, rows] += their sum, taken in
rank order so that all ranks hold bit-identical results, and the scaled stream's rows with it (tasks/base.py
store_residual). Row-parallel output `slot` is 2l (layer l's o_proj) or 2l + 1 (its MLP), so the norm that reads
the stream next is norm `slot + 1` in the stacked order (the post-attention one, or the next layer's input norm)."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.comm import sum_in_rank_order
from distmk.device import ring as rg
from distmk.device.exchange import exchange_region
from distmk.tasks.base import TaskKind, store_residual, store_residual_gpu


@triton.jit
def allreduce_gpu(row0, nrows, slot, n, x, xs, norms, exchange, H: tl.constexpr, B_PAD: tl.constexpr,
                  WORLD: tl.constexpr, EXCHANGE_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr):
    reduce_rows(row0, nrows, slot, n, x, xs, norms + (slot + 1) * H, exchange, H, B_PAD, WORLD, EXCHANGE_SLOTS,
                BLOCK_N)


@triton.jit
def reduce_rows(row0, nrows, slot, n, x, xs, next_norm_w, exchange, H: tl.constexpr, B_PAD: tl.constexpr,
                WORLD: tl.constexpr, EXCHANGE_SLOTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's reduction into the residual stream and the scaled stream (next_norm_w: the weight of the
    RMSNorm that reads the stream next)."""
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
        g = tl.load(next_norm_w + row0 + cols, mask=cols < nrows, other=0.0).to(tl.float32)
        store_residual_gpu(x, xs, offs, mask, residual + total, g[None, :])


@gluon.jit
def allreduce_ring(row0, nrows, slot, n, x, xs, norms, exchange, H: gl.constexpr, B_PAD: gl.constexpr,
                   WORLD: gl.constexpr, EXCHANGE_SLOTS: gl.constexpr, O_PROJ_ROWS: gl.constexpr,
                   num_warps: gl.constexpr):
    """reduce_rows in Gluon: the same sum, in the same rank order."""
    CP: gl.constexpr = rg.next_power_of_2(O_PROJ_ROWS)
    layout: gl.constexpr = rg.exchange_layout(num_warps)
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(1, layout))
    rc = gl.arange(0, CP, layout=gl.SliceLayout(0, layout))
    next_norm_w = norms + (slot + 1) * H
    for j in range(0, nrows, CP):
        cols = j + rc
        mask = (rb < n)[:, None] & (cols < nrows)[None, :]
        offs = rb[:, None] * H + (row0 + cols)[None, :]
        residual = gl.load(x + offs, mask=mask, other=0.0).to(gl.float32)
        g = gl.load(next_norm_w + row0 + cols, mask=cols < nrows, other=0.0).to(gl.float32)
        total = gl.zeros([B_PAD, CP], gl.float32, layout)
        for src in gl.static_range(WORLD):
            region = rg.exchange_region(row0, slot, src, H, B_PAD, WORLD, EXCHANGE_SLOTS)
            total += gl.load(exchange + region + rb[:, None] * nrows + cols[None, :], mask=mask, other=0.0)
        rg.store_residual_ring(x, xs, offs, mask, residual + total, g[None, :])


class AllReduce(TaskKind):
    name = "allreduce"
    args = ("row0", "nrows", "slot")
    communicates = True
    gpu = allreduce_gpu
    ring = allreduce_ring

    def cost(self, shape, layer, a):
        return shape.batch * a[1] * (4 * shape.plan.tp + 8)

    def run(self, ctx, layer, a):
        row0, nrows, slot = a
        rows, cols = slice(0, ctx.num_rows), slice(row0, row0 + nrows)
        total = sum_in_rank_order(ctx.comm, ctx.published.pop(ctx.wait))
        store_residual(ctx, rows, cols, ctx.buf["x"][rows, cols].float() + total, slot + 1)
