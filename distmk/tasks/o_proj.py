"""A row tile of the attention output projection (row-parallel): attn @ Wo[rows]^T, into the residual
stream (tp=1) or pushed to every rank as this rank's partial sum (tp>1, summed by an allreduce task). In a sparse
layer at tp=1 it can also add its rows' share of the gate's logits (router_layer >= 0: tasks/router.py), and the
tile that adds the last share routes the layer (GraphConfig.fused_route: tasks/route.py route_if_last)."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import layer_scales, prefetch_l2
from distmk.tasks.base import PUSH_PARTIAL, TaskKind, _PUSH_PARTIAL, row_parallel_gpu, row_parallel_tile
from distmk.tasks.route import route_if_last, route_if_last_gpu, route_if_last_ring
from distmk.tasks.router import router_share, router_share_gpu, router_share_ring, router_share_weights


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def o_proj_gpu(layer, row0, nrows, mode, router_layer, n, rank, signal, attn, wo, wo_scale, x, xs, partial, norms,
               router, router_logits, router_partial, router_sumsq, route_arrivals, route_expert, route_weight,
               route_slot, route_unique, route_count, route_history, exchange, exchange_peers, counters,
               counter_peers, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr,
               EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
               SLOTS_PAD: tl.constexpr, NORM_TOPK: tl.constexpr, BATCH: tl.constexpr, ROUTER_PARTS: tl.constexpr,
               O_PROJ_ROWS: tl.constexpr, FUSED_ROUTE: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, WORLD: tl.constexpr, EXCHANGE_SLOTS: tl.constexpr,
               TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr):
    w = wo + layer.to(tl.int64) * H * HQ * D
    next_norm = norms + (2 * layer + 1) * H             # the post-attention norm
    row_parallel_gpu(attn, w, row0, nrows, mode, n, x, xs, next_norm, partial, 2 * layer, rank, signal, exchange,
                     exchange_peers, counters, counter_peers, HQ * D, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION,
                     WORLD, EXCHANGE_SLOTS, TRANSPORT, SIGNAL_ADD, layer_scales(wo_scale, layer, H, HQ * D))
    if EXPERTS > 0:
        if router_layer >= 0:
            router_share_gpu(layer, router_layer, row0, nrows, n, x, norms, router, router_partial, router_sumsq,
                             H, EXPERTS, EXPERTS_PAD, BATCH, O_PROJ_ROWS, B_PAD, BLOCK_N, DOT_PRECISION)
            if FUSED_ROUTE:
                route_if_last_gpu(router_layer, n, router_logits, router_partial, router_sumsq, route_arrivals,
                                  route_expert, route_weight, route_slot, route_unique, route_count, route_history, H,
                                  EPS, EXPERTS, EXPERTS_PAD, TOP_K, TOP_K_PAD, SLOTS_PAD, NORM_TOPK, BATCH,
                                  ROUTER_PARTS)


@triton.jit
def o_proj_prefetch(layer, row0, nrows, wo, H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, PREFETCH: tl.constexpr,
                    INTERPRET: tl.constexpr):
    prefetch_l2(wo + layer.to(tl.int64) * H * HQ * D + row0 * HQ * D, nrows * HQ * D, PREFETCH, INTERPRET)


@gluon.jit
def o_proj_weights(layer, row0, nrows, wo_desc, ring, ready, empty, c, H: gl.constexpr, HQ: gl.constexpr,
                   D: gl.constexpr, O_PROJ_ROWS: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    return rg.load_rows(wo_desc, layer * H + row0, nrows, HQ * D, ring, ready, empty, c, RING_INFLIGHT,
                        rg.packs_halves(wo_desc.dtype, O_PROJ_ROWS, HQ * D, ring.type))


@gluon.jit
def o_proj_ring(layer, row0, nrows, mode, router_layer, n, rank, signal, x, xs, partial, norms, router, router_logits,
                router_partial, router_sumsq, route_arrivals, route_expert, route_weight, route_slot, route_unique,
                route_count, route_history, exchange_peers, counter_peers, wo_scale, wo_desc, attn_desc, ring, ready,
                empty, xring, xready, c, cx, H: gl.constexpr, HQ: gl.constexpr, D: gl.constexpr, EPS: gl.constexpr,
                EXPERTS: gl.constexpr, EXPERTS_PAD: gl.constexpr, TOP_K: gl.constexpr, TOP_K_PAD: gl.constexpr,
                SLOTS_PAD: gl.constexpr, NORM_TOPK: gl.constexpr, BATCH: gl.constexpr, ROUTER_PARTS: gl.constexpr,
                O_PROJ_ROWS: gl.constexpr, FUSED_ROUTE: gl.constexpr, B_PAD: gl.constexpr, WORLD: gl.constexpr,
                EXCHANGE_SLOTS: gl.constexpr, SYSTEM_SCOPE: gl.constexpr, num_warps: gl.constexpr):
    """Added to the residual stream at tp=1, this rank's partial sum at tp > 1 (the lowering's mode)."""
    if EXPERTS > 0:
        share_weights = router_share_weights(layer, router_layer, row0, nrows, norms, router, H, EXPERTS, EXPERTS_PAD,
                                             O_PROJ_ROWS, num_warps)
    c, cx = rg.row_parallel_rows(wo_desc, rg.layer_scales(wo_scale, layer, H, HQ * D), attn_desc, 0, HQ * D, row0,
                                 nrows, n, x, xs, norms + (2 * layer + 1) * H, partial, mode == _PUSH_PARTIAL,
                                 rg.exchange_region(row0, 2 * layer, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS), signal,
                                 exchange_peers, counter_peers, H, WORLD, SYSTEM_SCOPE, ring, ready, empty, xring,
                                 xready, c, cx, num_warps,
                                 rg.packs_halves(wo_desc.dtype, O_PROJ_ROWS, HQ * D, ring.type))
    if EXPERTS > 0:
        if router_layer >= 0:
            router_share_ring(row0, nrows, n, x, router_partial, router_sumsq, share_weights, H, EXPERTS,
                              EXPERTS_PAD, BATCH, O_PROJ_ROWS, num_warps)
            if FUSED_ROUTE:
                route_if_last_ring(router_layer, n, router_logits, router_partial, router_sumsq, route_arrivals,
                                   route_expert, route_weight, route_slot, route_unique, route_count, route_history,
                                   H, EPS, EXPERTS, EXPERTS_PAD, TOP_K, TOP_K_PAD, SLOTS_PAD, NORM_TOPK, BATCH,
                                   ROUTER_PARTS, num_warps)
    return c, cx


class OProj(TaskKind):
    name = "o_proj"
    args = ("row0", "nrows", "mode", "router_layer")     # router_layer: the sparse layer's index, or -1
    signals_all_ranks = ("mode", PUSH_PARTIAL)
    gpu = o_proj_gpu
    gpu_prefetch = o_proj_prefetch
    ring = o_proj_ring
    ring_weights = o_proj_weights

    def cost(self, shape, layer, a):
        share = shape.matmul_bytes(shape.spec.num_experts, a[1]) if a[3] >= 0 else 0
        return shape.matmul_bytes(a[1], shape.plan.num_heads * shape.spec.head_dim) + share

    def run(self, ctx, layer, a):
        row0, nrows, mode, router_layer = a
        row_parallel_tile(ctx, ctx.buf["attn"], ctx.weights.layers[layer].wo, row0, nrows, mode, 2 * layer + 1)
        if router_layer >= 0:
            router_share(ctx, layer, router_layer, row0, nrows)
            if ctx.fused_route:
                route_if_last(ctx, router_layer)
