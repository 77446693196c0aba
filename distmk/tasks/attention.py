"""Split-KV decode attention: for one row, one local KV head and one of S splits of the row's KV range,
the unnormalised partial output of the query heads that share that KV head, with its running max and
sum of exponentials (flash-decoding). The split bounds follow each row's position at run time, so one
table serves every context length; an empty split writes m=-inf, l=0, o=0."""
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.kernels.ring import next_power_of_2
from distmk.tasks.base import TaskKind


def kv_range(ctx, b: int) -> tuple[int, int]:
    """Positions [lo, hi) row b attends to: causal, and within the sliding window where the model has one."""
    hi = int(ctx.positions[b]) + 1
    window = ctx.spec.sliding_window
    return (max(0, hi - window) if window else 0), hi


def split_range(lo: int, hi: int, splits: int, s: int) -> tuple[int, int]:
    chunk = -(-(hi - lo) // splits)
    return min(hi, lo + s * chunk), min(hi, lo + (s + 1) * chunk)


@triton.jit
def attention_gpu(layer, a0, a1, a2, n, q, k_cache, v_cache, positions, block_table, attn_o, attn_m, attn_l,
                  D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                  MAXB: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr, S: tl.constexpr, WINDOW: tl.constexpr,
                  SCALE: tl.constexpr, BLOCK_T: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = a0
    kvh = a1
    split = a2
    if b < n:
        hi = tl.load(positions + b) + 1
        lo = hi * 0
        if WINDOW > 0:
            lo = tl.maximum(lo, hi - WINDOW)
        chunk = (hi - lo + S - 1) // S
        start = tl.minimum(hi, lo + split * chunk)
        stop = tl.minimum(hi, lo + (split + 1) * chunk)
        rg = tl.arange(0, G_PAD)
        rd = tl.arange(0, D)
        rt = tl.arange(0, BLOCK_T)
        heads = rg < G
        qt = tl.load(q + ((b * HQ + kvh * G + rg) * D)[:, None] + rd[None, :], mask=heads[:, None], other=0.0)
        m_i = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((G_PAD,), dtype=tl.float32)
        acc = tl.zeros((G_PAD, D), dtype=tl.float32)
        cache_layer = layer.to(tl.int64) * NBLK
        for t0 in range(start, stop, BLOCK_T):
            t = t0 + rt
            valid = t < stop
            block = tl.load(block_table + b * MAXB + t // BS, mask=valid, other=0).to(tl.int64)
            base = (((cache_layer + block) * BS + t % BS) * HKV + kvh) * D
            kt = tl.load(k_cache + base[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION) * SCALE
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_cache + base[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
            # probabilities stay float32 (exact fp32 product, as the reference computes p @ v)
            acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            m_i = m_new
        part = (b * HKV + kvh) * S + split
        tl.store(attn_o + (part * G + rg)[:, None] * D + rd[None, :], acc, mask=heads[:, None])
        tl.store(attn_m + part * G + rg, m_i, mask=heads)
        tl.store(attn_l + part * G + rg, l_i, mask=heads)


@gluon.constexpr_function
def attention_layout(D, num_warps):
    """[heads, keys, D] of the ring megakernel's attention: lanes along D (4 columns each), the rest of a warp
    and the warps along the keys."""
    lanes_d = max(1, min(32, D // 4))
    return gl.BlockedLayout([1, 1, 4], [1, 32 // lanes_d, lanes_d], [1, num_warps, 1], [2, 1, 0])


@gluon.jit
def attention_ring(layer, a0, a1, a2, n, q, k_cache, v_cache, positions, block_table, attn_o, attn_m, attn_l,
                   D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr,
                   MAXB: gl.constexpr, BS: gl.constexpr, NBLK: gl.constexpr, S: gl.constexpr, WINDOW: gl.constexpr,
                   SCALE: gl.constexpr, BLOCK_T: gl.constexpr, num_warps: gl.constexpr):
    """attention_gpu with the products as broadcast sums in float32 (no tl.dot outside wgmma in Gluon), so the
    query heads are padded to a power of two, not to the 16 rows of an mma."""
    G_PAD: gl.constexpr = next_power_of_2(G)
    b = a0
    kvh = a1
    split = a2
    if b < n:
        hi = gl.load(positions + b) + 1
        lo = hi * 0
        if WINDOW > 0:
            lo = gl.maximum(lo, hi - WINDOW)
        chunk = (hi - lo + S - 1) // S
        start = gl.minimum(hi, lo + split * chunk)
        stop = gl.minimum(hi, lo + (split + 1) * chunk)
        l3: gl.constexpr = attention_layout(D, num_warps)
        lq: gl.constexpr = gl.SliceLayout(1, l3)           # [heads, D]: queries, the output
        lk: gl.constexpr = gl.SliceLayout(0, l3)           # [keys, D]
        ls: gl.constexpr = gl.SliceLayout(2, l3)           # [heads, keys]: scores
        rg = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, lq))
        rd = gl.arange(0, D, layout=gl.SliceLayout(0, lq))
        rt = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(1, lk))
        rdk = gl.arange(0, D, layout=gl.SliceLayout(0, lk))
        rts = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, ls))
        rgs = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, ls))
        heads = rg < G
        qt = gl.load(q + ((b * HQ + kvh * G + rg) * D)[:, None] + rd[None, :], mask=heads[:, None],
                     other=0.0).to(gl.float32)
        m_i = gl.full([G_PAD], float("-inf"), gl.float32, layout=gl.SliceLayout(1, ls))
        l_i = gl.zeros([G_PAD], gl.float32, layout=gl.SliceLayout(1, ls))
        acc = gl.zeros([G_PAD, D], gl.float32, layout=lq)
        cache_layer = layer.to(gl.int64) * NBLK
        for t0 in range(start, stop, BLOCK_T):
            t = t0 + rt
            valid = t < stop
            block = gl.load(block_table + b * MAXB + t // BS, mask=valid, other=0).to(gl.int64)
            base = (((cache_layer + block) * BS + t % BS) * HKV + kvh) * D
            kt = gl.load(k_cache + base[:, None] + rdk[None, :], mask=valid[:, None], other=0.0).to(gl.float32)
            vt = gl.load(v_cache + base[:, None] + rdk[None, :], mask=valid[:, None], other=0.0).to(gl.float32)
            scores = gl.sum(qt[:, None, :] * kt[None, :, :], axis=2) * SCALE
            scores = gl.where((t0 + rts < stop)[None, :], scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            alpha = gl.exp(m_i - m_new)
            p = gl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            scale = gl.convert_layout(alpha, gl.SliceLayout(1, lq))
            acc = acc * scale[:, None] + gl.sum(p[:, :, None] * vt[None, :, :], axis=1)
            m_i = m_new
        part = (b * HKV + kvh) * S + split
        gl.store(attn_o + (part * G + rg)[:, None] * D + rd[None, :], acc, mask=heads[:, None])
        gl.store(attn_m + part * G + rgs, m_i, mask=rgs < G)
        gl.store(attn_l + part * G + rgs, l_i, mask=rgs < G)


class Attention(TaskKind):
    name = "attention"
    args = ("row", "kv_head", "split")
    gpu = attention_gpu
    ring = attention_ring

    def cost(self, shape, layer, a):
        d, g = shape.spec.head_dim, shape.plan.group
        keys = -(-shape.context // shape.kv_splits)
        return 2 * keys * d * shape.act_bytes + 2 * g * d * shape.act_bytes + g * d * 4

    def run(self, ctx, layer, a):
        b, kvh, s = a
        if b >= ctx.num_rows:
            return
        g = ctx.plan.group
        start, stop = split_range(*kv_range(ctx, b), ctx.kv_splits, s)
        o, m, l = ctx.buf["attn_o"], ctx.buf["attn_m"], ctx.buf["attn_l"]
        if start >= stop:
            o[b, kvh, s] = 0.0
            m[b, kvh, s] = -math.inf
            l[b, kvh, s] = 0.0
            return
        t = torch.arange(start, stop)
        blocks = ctx.block_table[b, t // ctx.block_size]
        k = ctx.k_cache[layer, blocks, t % ctx.block_size, kvh].float()      # [T, D]
        v = ctx.v_cache[layer, blocks, t % ctx.block_size, kvh].float()
        q = ctx.buf["q"][b, kvh * g:(kvh + 1) * g].float()                  # [g, D]
        scores = (q @ k.t()) * (1.0 / math.sqrt(ctx.spec.head_dim))         # [g, T]
        mx = scores.max(dim=-1).values
        p = torch.exp(scores - mx[:, None])
        o[b, kvh, s] = p @ v
        m[b, kvh, s] = mx
        l[b, kvh, s] = p.sum(-1)
