"""A row tile of the MLP's gate and up projections with the SiLU-gated product: h[:, rows] =
silu(xn @ Wgate[rows]^T) * (xn @ Wup[rows]^T), in float32, rounded once, where xn is the post-attention
RMSNorm of the residual stream (each product taken of the scaled stream, then scaled: tasks/base.py
normed_stream). Column-parallel: no communication."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import layer_scales, matmul_pair, norm_rstd, prefetch_l2
from distmk.tasks.base import TaskKind, normed_stream


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def gate_up_gpu(layer, row0, nrows, n, x, xs, w_gate, w_up, w_gate_scale, w_up_scale, h, H: tl.constexpr,
                INTER: tl.constexpr, B_PAD: tl.constexpr, EPS: tl.constexpr, NORM_BLOCK: tl.constexpr,
                MLP_BLOCK_N: tl.constexpr, MLP_BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offset = layer.to(tl.int64) * INTER * H
    act = h.dtype.element_ty
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, MLP_BLOCK_N)
    rstd = norm_rstd(x, n, H, EPS, B_PAD, NORM_BLOCK)[:, None]
    for j in range(0, nrows, MLP_BLOCK_N):
        gate, up = matmul_pair(xs, w_gate + offset, w_up + offset, n, row0 + j, nrows - j, H, B_PAD, MLP_BLOCK_N,
                               MLP_BLOCK_K, DOT_PRECISION, layer_scales(w_gate_scale, layer, INTER, H),
                               layer_scales(w_up_scale, layer, INTER, H))
        gate, up = gate * rstd, up * rstd
        mask = (rb < n)[:, None] & (rn < nrows - j)[None, :]
        tl.store(h + rb[:, None] * INTER + (row0 + j + rn)[None, :], (gate * tl.sigmoid(gate) * up).to(act),
                 mask=mask)


@triton.jit
def gate_up_prefetch(layer, row0, nrows, w_gate, w_up, H: tl.constexpr, INTER: tl.constexpr, PREFETCH: tl.constexpr,
                     INTERPRET: tl.constexpr):
    offset = layer.to(tl.int64) * INTER * H + row0 * H
    prefetch_l2(w_gate + offset, nrows * H, PREFETCH // 2, INTERPRET)
    prefetch_l2(w_up + offset, nrows * H, PREFETCH // 2, INTERPRET)


@gluon.jit
def gate_up_weights(layer, row0, nrows, w_gate_desc, w_up_desc, ring, ready, empty, c, H: gl.constexpr,
                    INTER: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    BN: gl.constexpr = ring.type.shape[1]
    first = c
    for j in range(0, nrows, BN):       # a block of gate rows, then the same rows of up
        row = layer * INTER + row0 + j
        c = rg.load_block(w_gate_desc, row, nrows - j, H, ring, ready, empty, c, first, RING_INFLIGHT)
        c = rg.load_block(w_up_desc, row, nrows - j, H, ring, ready, empty, c, first, RING_INFLIGHT)
    return c


@gluon.jit
def gate_up_ring(layer, row0, nrows, n, x, h, w_gate_scale, w_up_scale, w_gate_desc, w_up_desc, xs_desc, ring, ready,
                 empty, xring, xready, c, cx, H: gl.constexpr, INTER: gl.constexpr, EPS: gl.constexpr,
                 num_warps: gl.constexpr):
    BN: gl.constexpr = ring.type.shape[1]
    rg.prime_inputs(xs_desc, 0, H, xring, xready, cx)
    rstd = rg.norm_rstd(x, n, H, EPS, ring, xring, num_warps)[None, :]     # the post-attention RMSNorm's scale
    rn, rb = rg.block_index(ring, xring, num_warps)
    gate_scales = rg.layer_scales(w_gate_scale, layer, INTER, H)
    up_scales = rg.layer_scales(w_up_scale, layer, INTER, H)
    for j in range(0, nrows, BN):
        gate, up, c, cx = rg.gate_and_up(w_gate_desc, w_up_desc, gate_scales, up_scales, row0 + j, nrows - j, xs_desc,
                                         H, ring, ready, empty, xring, xready, c, cx, j + BN < nrows, num_warps)
        gate, up = gate * rstd, up * rstd
        mask = (rn < nrows - j)[:, None] & (rb < n)[None, :]
        value = gate / (1.0 + gl.exp(-gate)) * up
        gl.store(h + rb[None, :] * INTER + (row0 + j + rn)[:, None], value.to(h.dtype.element_ty), mask=mask)
    return c, cx


class GateUp(TaskKind):
    name = "gate_up"
    args = ("row0", "nrows")
    gpu = gate_up_gpu
    gpu_prefetch = gate_up_prefetch
    ring = gate_up_ring
    ring_weights = gate_up_weights

    def cost(self, shape, layer, a):
        return 2 * shape.matmul_bytes(a[1], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        row0, nrows = a
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xs, rstd = normed_stream(ctx)
        gate = (xs @ lw.w_gate[row0:row0 + nrows].float().t()) * rstd
        up = (xs @ lw.w_up[row0:row0 + nrows].float().t()) * rstd
        ctx.buf["h"][:n, row0:row0 + nrows] = (gate * torch.sigmoid(gate) * up).to(ctx.dtype)
