"""A tile of a sparse (mixture-of-experts) layer's router: the gate's logits of experts [expert0, expert0 +
nexperts) for every row, in float32, over the post-attention RMSNorm of the residual stream (tasks/base.py
normed_stream). The tiles of a layer cut its gate GEMV over the workers; the route task (tasks/route.py) then chooses
each row's experts from all the logits. Replicated under tensor parallelism: every rank computes every logit.

At tp=1 the o_proj tiles can do it instead (GraphConfig.router_partials 1, no router phase): the logits are
rstd * ((x * g) @ W^T), linear in the residual stream x but for the RMSNorm's scale rstd, so the tile that
finishes rows [row0, row0 + nrows) of x adds their share, (x * g) @ W[:, rows]^T and the sum of x^2 over them
(router_share), and the route task sums the shares in a fixed order and scales. The logits are then those of the
float32 normed stream, where router tiles round it to the activation dtype first (on the GPU the share's dot
rounds x * g to tf32, 10 bits of mantissa against bf16's 7)."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import matmul_block, norm_rstd
from distmk.tasks.base import TaskKind, normed_stream


# noinline, as the expert tiles: a function of its own, whose pipelined loads' shared memory is not added to the
# rest of the kernel's (inlined, these tasks took tiny-mistral's sm_90 megakernel past the 227 KB an SM has)
@triton.jit(noinline=True)
def router_gpu(sparse_layer, expert0, nexperts, n, x, xs, router, router_logits, H: tl.constexpr,
               EXPERTS: tl.constexpr, B_PAD: tl.constexpr, EPS: tl.constexpr, NORM_BLOCK: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rstd = norm_rstd(x, n, H, EPS, B_PAD, NORM_BLOCK)[:, None]     # the post-attention RMSNorm's scale
    w = router + sparse_layer.to(tl.int64) * EXPERTS * H
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    for j in range(0, nexperts, BLOCK_N):
        logits = matmul_block(xs, w, n, expert0 + j, nexperts - j, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)
        tl.store(router_logits + rb[:, None] * EXPERTS + (expert0 + j + rn)[None, :], logits * rstd,
                 mask=(rb < n)[:, None] & (rn < nexperts - j)[None, :])


@triton.jit(noinline=True)
def router_share_gpu(layer, sparse_layer, row0, nrows, n, x, norms, router, router_partial, router_sumsq,
                     H: tl.constexpr, EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, BATCH: tl.constexpr,
                     O_PROJ_ROWS: tl.constexpr, B_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """The share of rows [row0, row0 + nrows) of the residual stream, which this CTA has just stored, in the gate's
    logits: at share row0 // O_PROJ_ROWS of router_partial and router_sumsq (noinline: its [B_PAD, EXPERTS_PAD]
    accumulator stays out of the o_proj tile's registers)."""
    tl.debug_barrier()          # the whole CTA reads the rows its threads stored
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    re = tl.arange(0, EXPERTS_PAD)
    w = router + sparse_layer.to(tl.int64) * EXPERTS * H
    g_w = norms + (2 * layer + 1) * H                           # the post-attention RMSNorm's weight
    acc = tl.zeros((B_PAD, EXPERTS_PAD), dtype=tl.float32)
    sumsq = tl.zeros((B_PAD,), dtype=tl.float32)
    for j in range(0, nrows, BLOCK_N):
        cols = row0 + j + rn
        valid = rn < nrows - j
        xs = tl.load(x + rb[:, None] * H + cols[None, :], mask=(rb < n)[:, None] & valid[None, :], other=0.0)
        xs = xs.to(tl.float32)
        g = tl.load(g_w + cols, mask=valid, other=0.0).to(tl.float32)
        wr = tl.load(w + re[:, None] * H + cols[None, :], mask=(re < EXPERTS)[:, None] & valid[None, :], other=0.0)
        sumsq += tl.sum(xs * xs, axis=1)
        acc += tl.dot(xs * g[None, :], tl.trans(wr.to(tl.float32)), input_precision=DOT_PRECISION)
    share = row0 // O_PROJ_ROWS
    tl.store(router_partial + (share * BATCH + rb[:, None]) * EXPERTS + re[None, :], acc,
             mask=(rb < n)[:, None] & (re < EXPERTS)[None, :])
    tl.store(router_sumsq + share * BATCH + rb, sumsq, mask=rb < n)


@gluon.jit
def _share_columns(row0, nrows, EXPERTS_PAD: gl.constexpr, O_PROJ_ROWS: gl.constexpr, num_warps: gl.constexpr):
    """The experts, the residual stream's columns (the tile's rows) and which of them are the tile's, in the layout
    of the gate's [experts, rows] slice."""
    CP: gl.constexpr = rg.next_power_of_2(O_PROJ_ROWS)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [num_warps, 1], [1, 0])
    rc = gl.arange(0, CP, layout=gl.SliceLayout(0, layout))
    return gl.arange(0, EXPERTS_PAD, layout=gl.SliceLayout(1, layout)), row0 + rc, rc < nrows


@gluon.jit
def router_share_weights(layer, sparse_layer, row0, nrows, norms, router, H: gl.constexpr, EXPERTS: gl.constexpr,
                         EXPERTS_PAD: gl.constexpr, O_PROJ_ROWS: gl.constexpr, num_warps: gl.constexpr):
    """The gate's [experts, rows] slice and the post-attention norm's weight of the rows, none where the layer is
    dense (sparse_layer < 0): loaded before the o_proj tile's products, so their round trip overlaps them."""
    re, cols, valid = _share_columns(row0, nrows, EXPERTS_PAD, O_PROJ_ROWS, num_warps)
    valid = valid & (sparse_layer >= 0)
    w = gl.load(router + (sparse_layer.to(gl.int64) * EXPERTS + re[:, None]) * H + cols[None, :],
                mask=(re < EXPERTS)[:, None] & valid[None, :], other=0.0)
    g = gl.load(norms + (2 * layer + 1) * H + cols, mask=valid, other=0.0)
    return w, g


@gluon.jit
def router_share_ring(row0, nrows, n, x, router_partial, router_sumsq, weights, H: gl.constexpr,
                      EXPERTS: gl.constexpr, EXPERTS_PAD: gl.constexpr, BATCH: gl.constexpr,
                      O_PROJ_ROWS: gl.constexpr, num_warps: gl.constexpr):
    """router_share_gpu in Gluon, in float32 FMAs (the tl one's dot rounds to tf32), on router_share_weights' slice:
    each row's share is a reduction within 4 lanes."""
    rg.cta_barrier()            # the whole CTA reads the rows its threads stored
    re, cols, valid = _share_columns(row0, nrows, EXPERTS_PAD, O_PROJ_ROWS, num_warps)
    w, g = weights
    w = w.to(gl.float32)
    g = g.to(gl.float32)
    share = row0 // O_PROJ_ROWS
    for b in range(n):
        xb = gl.load(x + b * H + cols, mask=valid, other=0.0).to(gl.float32)
        gl.store(router_partial + (share * BATCH + b) * EXPERTS + re, gl.sum(w * (xb * g)[None, :], axis=1),
                 mask=re < EXPERTS)
        gl.store(router_sumsq + share * BATCH + b, gl.sum(xb * xb, axis=0))


def router_share(ctx, layer: int, sparse_layer: int, row0: int, nrows: int) -> None:
    """router_share_gpu's semantics: rows [row0, row0 + nrows) of the residual stream's share of the logits."""
    lw, n = ctx.weights.layers[layer], ctx.num_rows
    rows = slice(row0, row0 + nrows)
    x = ctx.buf["x"][:n, rows].float()
    share = row0 // ctx.o_proj_rows
    ctx.buf["router_partial"][share, :n] = (x * lw.post_norm[rows].float()) @ lw.router[:, rows].float().t()
    ctx.buf["router_sumsq"][share, :n] = (x * x).sum(-1)


def router_logits(ctx, partials: int) -> torch.Tensor:
    """The gate's logits [rows, experts] of the step's rows: the router tiles', or the sum of the o_proj tiles'
    shares, scaled by the RMSNorm's rstd (partials 1)."""
    n = ctx.num_rows
    if not partials:
        return ctx.buf["router_logits"][:n]
    sumsq = ctx.buf["router_sumsq"][:, :n].sum(0)
    rstd = torch.rsqrt(sumsq / ctx.spec.hidden_size + ctx.spec.rms_norm_eps)
    return ctx.buf["router_partial"][:, :n].sum(0) * rstd[:, None]


@gluon.jit
def router_weights(sparse_layer, expert0, nexperts, router_desc, ring, ready, empty, c, H: gl.constexpr,
                   EXPERTS: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    return rg.load_rows(router_desc, sparse_layer * EXPERTS + expert0, nexperts, H, ring, ready, empty, c,
                        RING_INFLIGHT)


@gluon.jit
def router_ring(expert0, nexperts, n, x, router_logits, xs_desc, ring, ready, empty, xring, xready, c, cx,
                H: gl.constexpr, EXPERTS: gl.constexpr, EPS: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = ring.type.shape[1]
    rg.prime_inputs(xs_desc, 0, H, xring, xready, cx)
    rstd = rg.norm_rstd(x, n, H, EPS, ring, xring, num_warps)[None, :]     # the post-attention RMSNorm's scale
    rn, rb = rg.block_index(ring, xring, num_warps)
    for j in range(0, nexperts, BN):
        logits, c, cx = rg.mma_block(xs_desc, 0, H, ring, ready, empty, xring, xready, c, cx, True,
                                     j + BN < nexperts, num_warps)
        gl.store(router_logits + rb[None, :] * EXPERTS + (expert0 + j + rn)[:, None], logits * rstd,
                 mask=(rn < nexperts - j)[:, None] & (rb < n)[None, :])
    return c, cx


class Router(TaskKind):
    name = "router"
    args = ("sparse_layer", "expert0", "nexperts")   # sparse_layer: the layer's index among the sparse ones
    gpu = router_gpu
    ring = router_ring
    ring_weights = router_weights

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[2], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        _, expert0, nexperts = a
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xs, rstd = normed_stream(ctx)
        experts = slice(expert0, expert0 + nexperts)
        ctx.buf["router_logits"][:n, experts] = (xs @ lw.router[experts].float().t()) * rstd
