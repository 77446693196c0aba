"""A row tile of the MLP down projection (row-parallel): h @ Wdown[rows]^T, into the residual stream
(tp=1) or pushed to every rank as this rank's partial sum (tp>1, summed by an allreduce task)."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import layer_scales, prefetch_l2
from distmk.tasks.base import PUSH_PARTIAL, TaskKind, _PUSH_PARTIAL, row_parallel_gpu, row_parallel_tile


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def down_gpu(layer, row0, nrows, mode, n, rank, signal, h, w_down, w_down_scale, x, xs, norms, partial, exchange,
             exchange_peers, counters, counter_peers, H: tl.constexpr, INTER: tl.constexpr, B_PAD: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, WORLD: tl.constexpr,
             EXCHANGE_SLOTS: tl.constexpr, TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr):
    w = w_down + layer.to(tl.int64) * H * INTER
    next_norm = norms + (2 * layer + 2) * H             # the next layer's input norm, or the final one
    row_parallel_gpu(h, w, row0, nrows, mode, n, x, xs, next_norm, partial, 2 * layer + 1, rank, signal, exchange,
                     exchange_peers, counters, counter_peers, INTER, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION,
                     WORLD, EXCHANGE_SLOTS, TRANSPORT, SIGNAL_ADD, layer_scales(w_down_scale, layer, H, INTER))


@triton.jit
def down_prefetch(layer, row0, nrows, w_down, H: tl.constexpr, INTER: tl.constexpr, PREFETCH: tl.constexpr,
                  INTERPRET: tl.constexpr):
    prefetch_l2(w_down + layer.to(tl.int64) * H * INTER + row0 * INTER, nrows * INTER, PREFETCH, INTERPRET)


@gluon.jit
def down_weights(layer, row0, nrows, w_down_desc, ring, ready, empty, c, H: gl.constexpr, INTER: gl.constexpr,
                 O_PROJ_ROWS: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    return rg.load_rows(w_down_desc, layer * H + row0, nrows, INTER, ring, ready, empty, c, RING_INFLIGHT,
                        rg.packs_halves(w_down_desc.dtype, O_PROJ_ROWS, INTER, ring.type))


@gluon.jit
def down_ring(layer, row0, nrows, mode, n, rank, signal, x, xs, norms, partial, exchange_peers, counter_peers,
              w_down_scale, w_down_desc, h_desc, ring, ready, empty, xring, xready, c, cx, H: gl.constexpr,
              INTER: gl.constexpr, O_PROJ_ROWS: gl.constexpr, B_PAD: gl.constexpr, WORLD: gl.constexpr,
              EXCHANGE_SLOTS: gl.constexpr, SYSTEM_SCOPE: gl.constexpr, num_warps: gl.constexpr):
    """Added to the residual stream at tp=1, this rank's partial sum at tp > 1 (the lowering's mode)."""
    return rg.row_parallel_rows(w_down_desc, rg.layer_scales(w_down_scale, layer, H, INTER), h_desc, 0, INTER, row0,
                                nrows, n, x, xs, norms + (2 * layer + 2) * H, partial, mode == _PUSH_PARTIAL,
                                rg.exchange_region(row0, 2 * layer + 1, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS), signal,
                                exchange_peers, counter_peers, H, WORLD, SYSTEM_SCOPE, ring, ready, empty, xring,
                                xready, c, cx, num_warps, rg.packs_halves(w_down_desc.dtype, O_PROJ_ROWS, INTER,
                                                                         ring.type))


class Down(TaskKind):
    name = "down"
    args = ("row0", "nrows", "mode")
    signals_all_ranks = ("mode", PUSH_PARTIAL)
    gpu = down_gpu
    gpu_prefetch = down_prefetch
    ring = down_ring
    ring_weights = down_weights

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.plan.inter)

    def run(self, ctx, layer, a):
        row0, nrows, mode = a
        row_parallel_tile(ctx, ctx.buf["h"], ctx.weights.layers[layer].w_down, row0, nrows, mode, 2 * layer + 2)
