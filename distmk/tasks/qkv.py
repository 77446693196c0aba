"""A row tile of the fused QKV projection for all rows: rows [row0, row0 + nrows) of Wqkv (the query heads', then
the key heads', then the value heads', head_dim rows each) over the input-RMSNormed residual stream (tasks/base.py
normed_stream), plus the bias. Query and key columns are stored as they are, in float32, to qk_raw: RoPE and
q/k-norm (Qwen3) pair or reduce over a whole head, so the attention tasks that read a head finish it
(tasks/attention.py). Value columns go to the paged KV cache at each row's position. A tile may start and end
anywhere, so the phase is cut into one tile per worker: tiles of whole heads or of a head's column slices (the two
RoPE halves together) made 96 tiles for 132 workers at the 8B models, a third more bytes for the busiest."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import layer_scales, matmul_block, norm_rstd, prefetch_l2
from distmk.tasks.base import TaskKind, normed_stream, rms_norm, rope


@triton.jit
def _value_slots(layer, rb, n, positions, block_table, D: tl.constexpr, HKV: tl.constexpr, MAXB: tl.constexpr,
                 BS: tl.constexpr, NBLK: tl.constexpr):
    """Element offset of each row's value heads (head 0, column 0) at its position of the paged cache."""
    pos = tl.load(positions + rb, mask=rb < n, other=0)
    page = tl.load(block_table + rb * MAXB + pos // BS, mask=rb < n, other=0).to(tl.int64)
    return ((layer.to(tl.int64) * NBLK + page) * BS + pos % BS) * (HKV * D)


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def qkv_gpu(layer, row0, nrows, n, x, xs, wqkv, wqkv_scale, bqkv, positions, block_table, qk_raw, v_cache,
            H: tl.constexpr,
            D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, B_PAD: tl.constexpr, MAXB: tl.constexpr,
            BS: tl.constexpr, NBLK: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr,
            NORM_BLOCK: tl.constexpr, QKV_BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    ROWS: tl.constexpr = (HQ + 2 * HKV) * D
    QK: tl.constexpr = (HQ + HKV) * D                              # the query and key columns, qk_raw's width
    w = wqkv + layer.to(tl.int64) * ROWS * H
    rstd = norm_rstd(x, n, H, EPS, B_PAD, NORM_BLOCK)[:, None]     # the input RMSNorm's scale
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, QKV_BLOCK_N)
    values = _value_slots(layer, rb, n, positions, block_table, D, HKV, MAXB, BS, NBLK)
    rows = (rb < n)[:, None]
    for j in range(0, nrows, QKV_BLOCK_N):
        out = matmul_block(xs, w, n, row0 + j, nrows - j, H, B_PAD, QKV_BLOCK_N, BLOCK_K, DOT_PRECISION,
                           layer_scales(wqkv_scale, layer, ROWS, H)) * rstd
        cols = row0 + j + rn
        valid = rn < nrows - j
        if HAS_BIAS:
            out += tl.load(bqkv + layer * ROWS + cols, mask=valid, other=0.0).to(tl.float32)[None, :]
        tl.store(qk_raw + rb[:, None] * QK + cols[None, :], out, mask=rows & (valid & (cols < QK))[None, :])
        tl.store(v_cache + values[:, None] + (cols - QK)[None, :], out.to(v_cache.dtype.element_ty),
                 mask=rows & (valid & (cols >= QK))[None, :])


@triton.jit
def qkv_prefetch(layer, row0, nrows, wqkv, H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                 PREFETCH: tl.constexpr, INTERPRET: tl.constexpr):
    rows: tl.constexpr = (HQ + 2 * HKV) * D
    prefetch_l2(wqkv + layer.to(tl.int64) * rows * H + row0 * H, nrows * H, PREFETCH, INTERPRET)


@gluon.jit
def qkv_weights(layer, row0, nrows, wqkv_desc, ring, ready, empty, c, H: gl.constexpr, D: gl.constexpr,
                HQ: gl.constexpr, HKV: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    return rg.load_rows(wqkv_desc, layer * (HQ + 2 * HKV) * D + row0, nrows, H, ring, ready, empty, c, RING_INFLIGHT)


@gluon.jit
def qkv_ring(layer, row0, nrows, n, x, bqkv, positions, block_table, qk_raw, v_cache, wqkv_scale, wqkv_desc, xs_desc,
             ring, ready, empty, xring, xready, c, cx, H: gl.constexpr, D: gl.constexpr, HQ: gl.constexpr,
             HKV: gl.constexpr, MAXB: gl.constexpr, BS: gl.constexpr, NBLK: gl.constexpr, EPS: gl.constexpr,
             HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    """qkv_gpu on the weight ring, a block of BN rows at a time ([rows, batch] accumulators)."""
    BN: gl.constexpr = ring.type.shape[1]
    ROWS: gl.constexpr = (HQ + 2 * HKV) * D
    QK: gl.constexpr = (HQ + HKV) * D
    rg.prime_inputs(xs_desc, 0, H, xring, xready, cx)
    rstd = rg.norm_rstd(x, n, H, EPS, ring, xring, num_warps)[None, :]     # the input RMSNorm's scale
    rn, rb = rg.block_index(ring, xring, num_warps)
    pos = gl.load(positions + rb, mask=rb < n, other=0)
    page = gl.load(block_table + rb * MAXB + pos // BS, mask=rb < n, other=0).to(gl.int64)
    values = ((layer.to(gl.int64) * NBLK + page) * BS + pos % BS) * (HKV * D)     # _value_slots
    rows = (rb < n)[None, :]
    scales = rg.layer_scales(wqkv_scale, layer, ROWS, H)
    for j in range(0, nrows, BN):
        out, c, cx = rg.mma_rows(wqkv_desc, scales, row0 + j, nrows - j, xs_desc, 0, H, ring, ready, empty, xring,
                                 xready, c, cx, True, j + BN < nrows, num_warps)
        out = out * rstd
        cols = row0 + j + rn
        valid = rn < nrows - j
        if HAS_BIAS:
            out += gl.load(bqkv + layer * ROWS + cols, mask=valid, other=0.0).to(gl.float32)[:, None]
        gl.store(qk_raw + rb[None, :] * QK + cols[:, None], out, mask=(valid & (cols < QK))[:, None] & rows)
        gl.store(v_cache + values[None, :] + (cols - QK)[:, None], out.to(v_cache.dtype.element_ty),
                 mask=(valid & (cols >= QK))[:, None] & rows)
    return c, cx


class QKV(TaskKind):
    name = "qkv"
    args = ("row0", "nrows")       # rows of this rank's Wqkv: query heads, then key heads, then value heads
    gpu = qkv_gpu
    gpu_prefetch = qkv_prefetch
    ring = qkv_ring
    ring_weights = qkv_weights

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        row0, nrows = a
        spec, plan, lw = ctx.spec, ctx.plan, ctx.weights.layers[layer]
        n, d, bs = ctx.num_rows, spec.head_dim, ctx.block_size
        xs, rstd = normed_stream(ctx)
        out = (xs @ lw.wqkv[row0:row0 + nrows].float().t()) * rstd
        if lw.bqkv is not None:
            out = out + lw.bqkv[row0:row0 + nrows].float()
        qk = (plan.num_heads + plan.num_kv_heads) * d
        cols = torch.arange(row0, row0 + nrows, device=out.device)
        raw = cols < qk
        ctx.buf["qk_raw"][:n].view(n, qk)[:, cols[raw]] = out[:, raw]
        v = cols[~raw] - qk
        pos = ctx.positions[:n]
        pages = ctx.block_table[torch.arange(n), pos // bs]
        ctx.v_cache[layer, pages[:, None], (pos % bs)[:, None], v // d, v % d] = out[:, ~raw].to(ctx.dtype)


def finish_heads(ctx, layer: int, is_q: bool, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q/k-norm (where the model has it) and RoPE of whole q or k heads raw [rows, heads, D] (float32, as QKV left
    them in qk_raw) at positions [rows], rounded once to the activation dtype: the queries attention multiplies,
    the keys the cache keeps."""
    spec, lw = ctx.spec, ctx.weights.layers[layer]
    if spec.qk_norm:
        raw = rms_norm(raw, lw.q_norm if is_q else lw.k_norm, spec.rms_norm_eps)
    return rope(raw, positions, ctx.weights.inv_freq).to(ctx.dtype)
