"""A row tile of a sparse layer's output: the routing-weighted sum of each row's expert outputs,
sum_k weight[b, k] * expert_out[b, k, rows], in float32 and in the fixed order k = 0, 1, ... (so a run is
reproducible whatever order the expert tiles ran in), added to the residual stream (tp=1) or pushed to every rank
as this rank's partial sum (tp>1, summed by an allreduce task), as a dense down tile's output is."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.exchange import exchange_region, push_signal
from distmk.tasks.base import PUSH_PARTIAL, TaskKind, _PUSH_PARTIAL, store_row_parallel, store_row_parallel_gpu


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def moe_combine_gpu(layer, row0, nrows, mode, n, rank, signal, route_weight, expert_out, x, xs, norms, partial,
                    exchange, exchange_peers, counters, counter_peers, H: tl.constexpr, TOP_K: tl.constexpr,
                    B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, WORLD: tl.constexpr, EXCHANGE_SLOTS: tl.constexpr,
                    TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    region = exchange_region(row0, 2 * layer + 1, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS)
    for j in range(0, nrows, BLOCK_N):
        cols = row0 + j + rn
        mask = (rb < n)[:, None] & (rn < nrows - j)[None, :]
        total = tl.zeros((B_PAD, BLOCK_N), dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            weight = tl.load(route_weight + rb * TOP_K + k, mask=rb < n, other=0.0)
            out = tl.load(expert_out + (rb * TOP_K + k)[:, None] * H + cols[None, :], mask=mask, other=0.0)
            total += weight[:, None] * out
        store_row_parallel_gpu(total, rb, rn, j, row0, nrows, mode, n, x, xs, norms + (2 * layer + 2) * H, partial,
                               region, exchange, exchange_peers, H, WORLD, TRANSPORT)
    if mode == _PUSH_PARTIAL:
        push_signal(region, n, nrows, rank, signal, exchange, counters, counter_peers, WORLD, TRANSPORT, SIGNAL_ADD)


@gluon.jit
def moe_combine_ring(layer, row0, nrows, mode, n, rank, signal, route_weight, expert_out, x, xs, norms, partial,
                     exchange_peers, counter_peers, H: gl.constexpr, TOP_K: gl.constexpr, B_PAD: gl.constexpr,
                     O_PROJ_ROWS: gl.constexpr, WORLD: gl.constexpr, EXCHANGE_SLOTS: gl.constexpr,
                     SYSTEM_SCOPE: gl.constexpr, num_warps: gl.constexpr):
    """A block of the tile's columns at a time: added to the residual stream at tp=1, at tp > 1 this rank's partial
    sum, pushed or stored by the lowering's mode (device/ring.py deliver_sums)."""
    CP: gl.constexpr = rg.next_power_of_2(O_PROJ_ROWS)
    layout: gl.constexpr = rg.exchange_layout(num_warps)
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(1, layout))
    rc = gl.arange(0, CP, layout=gl.SliceLayout(0, layout))
    region = rg.exchange_region(row0, 2 * layer + 1, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS)
    for j in range(0, nrows, CP):
        cols = row0 + j + rc
        mask = (rb < n)[:, None] & (rc < nrows - j)[None, :]
        offs = rb[:, None] * H + cols[None, :]
        residual = None
        g = None
        if WORLD == 1:
            residual = gl.load(x + offs, mask=mask, other=0.0).to(gl.float32)
            g = gl.load(norms + (2 * layer + 2) * H + cols, mask=rc < nrows - j, other=0.0).to(gl.float32)[None, :]
        total = gl.zeros([B_PAD, CP], gl.float32, layout)
        for k in gl.static_range(TOP_K):
            weight = gl.load(route_weight + rb * TOP_K + k, mask=rb < n, other=0.0)
            out = gl.load(expert_out + (rb * TOP_K + k)[:, None] * H + cols[None, :], mask=mask, other=0.0)
            total += weight[:, None] * out
        rg.deliver_sums(total, x, xs, offs, mask, residual, g, partial, mode == _PUSH_PARTIAL,
                        region + rb[:, None] * nrows + (j + rc)[None, :], exchange_peers, WORLD)
    if WORLD > 1:
        if mode == _PUSH_PARTIAL:
            rg.signal_all_ranks(counter_peers, signal, WORLD, SYSTEM_SCOPE, num_warps)


class MoeCombine(TaskKind):
    name = "moe_combine"
    args = ("row0", "nrows", "mode")
    signals_all_ranks = ("mode", PUSH_PARTIAL)
    gpu = moe_combine_gpu
    ring = moe_combine_ring

    def cost(self, shape, layer, a):
        return shape.batch * a[1] * 4 * (shape.spec.experts_per_token + 2)

    def run(self, ctx, layer, a):
        row0, nrows, mode = a
        n = ctx.num_rows
        total = weighted_sum(ctx.buf["route_weight"][:n], ctx.buf["expert_out"][:n, :, row0:row0 + nrows])
        store_row_parallel(ctx, total, row0, nrows, mode, 2 * layer + 2)


def weighted_sum(weights: torch.Tensor, outs: torch.Tensor) -> torch.Tensor:
    """sum_k weights[:, k] * outs[:, k] of [rows, top_k] weights and [rows, top_k, cols] expert outputs, in
    float32, k = 0 first (the combine tiles' semantics, and the prefill path's)."""
    total = outs.new_zeros(outs.shape[0], outs.shape[2], dtype=torch.float32)
    for k in range(outs.shape[1]):
        total += weights[:, k, None].float() * outs[:, k].float()
    return total
