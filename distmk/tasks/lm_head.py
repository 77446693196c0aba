"""A row tile of the vocab-parallel lm_head over the final RMSNorm of the residual stream (tasks/base.py
normed_stream): logits for this rank's vocabulary rows, plus the tile's argmax per batch row (first index on ties;
padding rows past the vocabulary never win)."""
import math

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import matmul_block, norm_rstd, prefetch_l2
from distmk.tasks.base import TaskKind, normed_stream


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def lm_head_gpu(row0, nrows, tile, n, x, xs, lm_head, logits, tile_max, tile_arg, vocab0, vocab_valid,
                H: tl.constexpr, VOCAB_L: tl.constexpr, LM_TILES: tl.constexpr, B_PAD: tl.constexpr, EPS: tl.constexpr,
                NORM_BLOCK: tl.constexpr, LM_BLOCK_N: tl.constexpr, LM_BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, LM_BLOCK_N)
    best = tl.full((B_PAD,), float("-inf"), dtype=tl.float32)
    best_id = tl.full((B_PAD,), -1, dtype=tl.int64)
    rstd = norm_rstd(x, n, H, EPS, B_PAD, NORM_BLOCK)[:, None]     # the final RMSNorm's scale
    for j in range(0, nrows, LM_BLOCK_N):
        block0 = row0 + j
        acc = matmul_block(xs, lm_head, n, block0, nrows - j, H, B_PAD, LM_BLOCK_N, LM_BLOCK_K, DOT_PRECISION)
        acc = acc * rstd
        cols = rn < nrows - j
        tl.store(logits + rb[:, None] * VOCAB_L + (block0 + rn)[None, :], acc, mask=(rb < n)[:, None] & cols[None, :])
        scores = tl.where((cols & (block0 + rn < vocab_valid))[None, :], acc, float("-inf"))
        block_max = tl.max(scores, axis=1)
        block_arg = tl.argmax(scores, axis=1, tie_break_left=True)
        better = block_max > best                   # strict: an earlier block keeps a tie
        best_id = tl.where(better, (block_arg + block0 + vocab0).to(tl.int64), best_id)
        best = tl.where(better, block_max, best)
    tl.store(tile_max + rb * LM_TILES + tile, best, mask=rb < n)
    tl.store(tile_arg + rb * LM_TILES + tile, best_id, mask=rb < n)


@triton.jit
def lm_head_prefetch(row0, nrows, lm_head, H: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr):
    prefetch_l2(lm_head + row0.to(tl.int64) * H, nrows * H, PREFETCH, INTERPRET)


@gluon.jit
def lm_head_weights(row0, nrows, lm_head_desc, ring, ready, empty, c, H: gl.constexpr,
                    RING_INFLIGHT: gl.constexpr):
    return rg.load_rows(lm_head_desc, row0, nrows, H, ring, ready, empty, c, RING_INFLIGHT)


@gluon.jit
def lm_head_ring(row0, nrows, tile, n, x, logits, tile_max, tile_arg, vocab0, vocab_valid, xs_desc, ring, ready,
                 empty, xring, xready, c, cx, H: gl.constexpr, VOCAB_L: gl.constexpr, LM_TILES: gl.constexpr,
                 EPS: gl.constexpr, num_warps: gl.constexpr):
    BN: gl.constexpr = ring.type.shape[1]
    rn, rb = rg.block_index(ring, xring, num_warps)
    best = gl.full(rb.type.shape, float("-inf"), gl.float32, layout=rb.type.layout)
    best_id = gl.full(rb.type.shape, -1, gl.int64, layout=rb.type.layout)
    rg.prime_inputs(xs_desc, 0, H, xring, xready, cx)
    rstd = rg.norm_rstd(x, n, H, EPS, ring, xring, num_warps)[None, :]     # the final RMSNorm's scale
    for j in range(0, nrows, BN):
        block0 = row0 + j
        acc, c, cx = rg.mma_block(xs_desc, 0, H, ring, ready, empty, xring, xready, c, cx, True, j + BN < nrows,
                                  num_warps)
        acc = acc * rstd
        rows = rn < nrows - j
        gl.store(logits + rb[None, :] * VOCAB_L + (block0 + rn)[:, None], acc, mask=rows[:, None] & (rb < n)[None, :])
        scores = gl.where((rows & (block0 + rn < vocab_valid))[:, None], acc, float("-inf"))
        block_max = gl.max(scores, axis=0)
        # the first row that reaches the maximum (a row of -inf scores keeps best_id)
        block_arg = gl.min(gl.where(scores == block_max[None, :], rn[:, None], BN), axis=0)
        better = block_max > best                   # strict: an earlier block keeps a tie
        best_id = gl.where(better, (block_arg + block0 + vocab0).to(gl.int64), best_id)
        best = gl.where(better, block_max, best)
    gl.store(tile_max + rb * LM_TILES + tile, best, mask=rb < n)
    gl.store(tile_arg + rb * LM_TILES + tile, best_id, mask=rb < n)
    return c, cx


class LMHead(TaskKind):
    name = "lm_head"
    args = ("row0", "nrows", "tile")
    gpu = lm_head_gpu
    gpu_prefetch = lm_head_prefetch
    ring = lm_head_ring
    ring_weights = lm_head_weights

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        row0, nrows, tile = a
        n = ctx.num_rows
        xs, rstd = normed_stream(ctx)
        logits = (xs @ ctx.weights.lm_head[row0:row0 + nrows].float().t()) * rstd
        ctx.buf["logits"][:n, row0:row0 + nrows] = logits
        valid = max(0, min(nrows, ctx.plan.vocab_valid - row0))
        if valid == 0:
            ctx.buf["tile_max"][:n, tile] = -math.inf
            ctx.buf["tile_arg"][:n, tile] = -1
            return
        mx, arg = logits[:, :valid].max(dim=-1)
        ctx.buf["tile_max"][:n, tile] = mx
        ctx.buf["tile_arg"][:n, tile] = arg + ctx.plan.vocab0 + row0
