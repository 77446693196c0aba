"""One head of the fused QKV projection for all rows, of the input-RMSNormed residual stream (the norm is
computed by each tile): matmul (+bias), then for q and k heads the
per-head q/k-norm (Qwen3) and RoPE; q goes to the q buffer, k and v are appended to the paged KV cache
at each row's position. A tile is one head so that norm and RoPE see whole heads."""
import torch
import triton
import triton.language as tl

from distmk.kernels.primitives import matmul_pair, prefetch_l2, rms_norm_rows
from distmk.tasks.base import TaskKind, normed_stream, rms_norm, rope


@triton.jit
def store_kv(cache, layer, head, lo, hi, rb, rd, pos, n, block_table, D: tl.constexpr, HKV: tl.constexpr,
             MAXB: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr):
    """Write one head's [rows, D] (as two halves) at each row's position of the paged cache."""
    rows = rb < n
    block = tl.load(block_table + rb * MAXB + pos // BS, mask=rows, other=0).to(tl.int64)
    base = (((layer.to(tl.int64) * NBLK + block) * BS + pos % BS) * HKV + head) * D
    mask = rows[:, None] & (rd < D // 2)[None, :]
    act = cache.dtype.element_ty
    tl.store(cache + base[:, None] + rd[None, :], lo.to(act), mask=mask)
    tl.store(cache + base[:, None] + D // 2 + rd[None, :], hi.to(act), mask=mask)


@triton.jit
def qkv_gpu(layer, a0, n, worker, x, xn, norms, wqkv, bqkv, qk_norm, inv_freq, positions, block_table, q, k_cache, v_cache,
            H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, B_PAD: tl.constexpr,
            HALF_PAD: tl.constexpr, MAXB: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr, EPS: tl.constexpr,
            HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, NORM_BLOCK: tl.constexpr, QKV_BLOCK_K: tl.constexpr,
            DOT_PRECISION: tl.constexpr):
    # The head's two halves are separate accumulators, so rotate-half RoPE pairs columns elementwise.
    HALF: tl.constexpr = D // 2
    rows: tl.constexpr = (HQ + 2 * HKV) * D
    slot = a0
    w = wqkv + layer.to(tl.int64) * rows * H
    inp = xn + worker * B_PAD * H                                 # input RMSNorm, by this tile
    rms_norm_rows(x, n, norms + 2 * layer * H, inp, H, EPS, B_PAD, NORM_BLOCK)
    lo, hi = matmul_pair(inp, w, w + HALF * H, n, slot * D, HALF, H, B_PAD, HALF_PAD, QKV_BLOCK_K, DOT_PRECISION)
    rd = tl.arange(0, HALF_PAD)
    dmask = rd < HALF
    if HAS_BIAS:
        bias = bqkv + layer * rows + slot * D
        lo += tl.load(bias + rd, mask=dmask, other=0.0).to(tl.float32)[None, :]
        hi += tl.load(bias + HALF + rd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    act = q.dtype.element_ty
    rb = tl.arange(0, B_PAD)
    pos = tl.load(positions + rb, mask=rb < n, other=0)
    if slot < HQ + HKV:
        is_k = slot >= HQ
        if QK_NORM:
            rstd = tl.math.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D + EPS)
            weight = qk_norm + (2 * layer + is_k) * D        # [layers, 2, D]: q_norm, k_norm
            lo = lo * rstd[:, None] * tl.load(weight + rd, mask=dmask).to(tl.float32)
            hi = hi * rstd[:, None] * tl.load(weight + HALF + rd, mask=dmask).to(tl.float32)
        angle = pos[:, None].to(tl.float32) * tl.load(inv_freq + rd, mask=dmask, other=0.0)[None, :]
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        rotated_lo = lo * cos - hi * sin
        hi = hi * cos + lo * sin
        lo = rotated_lo
        if is_k:
            store_kv(k_cache, layer, slot - HQ, lo, hi, rb, rd, pos, n, block_table, D, HKV, MAXB, BS, NBLK)
        else:
            dst = q + (rb[:, None] * HQ + slot) * D + rd[None, :]
            mask = (rb < n)[:, None] & dmask[None, :]
            tl.store(dst, lo.to(act), mask=mask)
            tl.store(dst + HALF, hi.to(act), mask=mask)
    else:
        store_kv(v_cache, layer, slot - HQ - HKV, lo, hi, rb, rd, pos, n, block_table, D, HKV, MAXB, BS, NBLK)


@triton.jit
def qkv_prefetch(layer, a0, wqkv, H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                 PREFETCH: tl.constexpr, INTERPRET: tl.constexpr):
    # a head's weights are small and its phase leaves most workers idle: fetch up to 4x the usual amount
    rows: tl.constexpr = (HQ + 2 * HKV) * D
    prefetch_l2(wqkv + layer.to(tl.int64) * rows * H + a0 * D * H, a0 * 0 + D * H, 4 * PREFETCH, INTERPRET)


class QKV(TaskKind):
    name = "qkv"
    args = ("head_slot",)  # 0..hq-1: query heads, then hkv key heads, then hkv value heads (local)
    gpu = qkv_gpu
    gpu_prefetch = qkv_prefetch

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(shape.spec.head_dim, shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        (slot,) = a
        spec, plan, lw = ctx.spec, ctx.plan, ctx.weights.layers[layer]
        d, n = spec.head_dim, ctx.num_rows
        rows = slice(slot * d, (slot + 1) * d)
        out = normed_stream(ctx, lw.input_norm).float() @ lw.wqkv[rows].float().t()
        if lw.bqkv is not None:
            out = out + lw.bqkv[rows].float()
        out = out[:, None, :]                                       # [n, 1, D], float32 until stored
        pos = ctx.positions[:n]
        if slot < plan.num_heads + plan.num_kv_heads:               # q or k: norm, then rotate
            is_q = slot < plan.num_heads
            if spec.qk_norm:
                out = rms_norm(out, lw.q_norm if is_q else lw.k_norm, spec.rms_norm_eps)
            out = rope(out, pos, ctx.weights.inv_freq)
            if is_q:
                ctx.buf["q"][:n, slot] = out[:, 0].to(ctx.dtype)
                return
            cache, head = ctx.k_cache, slot - plan.num_heads
        else:
            cache, head = ctx.v_cache, slot - plan.num_heads - plan.num_kv_heads
        blocks = ctx.block_table[torch.arange(n), pos // ctx.block_size]
        cache[layer, blocks, pos % ctx.block_size, head] = out[:, 0].to(ctx.dtype)
