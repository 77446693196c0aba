"""One head of the fused QKV projection for all rows, or a column slice of it, of the input-RMSNormed residual
stream (tasks/base.py normed_stream): matmul (+bias), then for q and k heads the per-head q/k-norm
(Qwen3) and RoPE; q goes to the q buffer, k and v are appended to the paged KV cache at each row's
position. Part p of P covers columns [p, p+1) * D/2P of both halves of the head, so rotate-half RoPE pairs
columns inside one tile. q/k-norm needs the whole head: with P > 1 (raw_qk) a q or k slice is left unnormalised
in qk_raw, and the attention tasks that read the head finish it (tasks/attention.py): a finishing task of its own
between the two phases cost qwen3-8b 3.5-4 us a layer."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import matmul_pair, norm_rstd, prefetch_l2
from distmk.tasks.base import TaskKind, normed_stream, rms_norm, rope


@triton.jit
def store_kv(cache, layer, head, col0, cols, lo, hi, rb, rd, pos, n, block_table, D: tl.constexpr,
             HKV: tl.constexpr, MAXB: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr):
    """Write columns col0 + [0, cols) of both halves of one head's [rows, D] at each row's position of the
    paged cache."""
    rows = rb < n
    block = tl.load(block_table + rb * MAXB + pos // BS, mask=rows, other=0).to(tl.int64)
    base = (((layer.to(tl.int64) * NBLK + block) * BS + pos % BS) * HKV + head) * D + col0
    mask = rows[:, None] & (rd < cols)[None, :]
    act = cache.dtype.element_ty
    tl.store(cache + base[:, None] + rd[None, :], lo.to(act), mask=mask)
    tl.store(cache + base[:, None] + D // 2 + rd[None, :], hi.to(act), mask=mask)


@triton.jit
def norm_rope_store(lo, hi, layer, slot, col0, cols, rd, n, qk_norm, inv_freq, positions, block_table, q, k_cache,
                    D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, B_PAD: tl.constexpr, MAXB: tl.constexpr,
                    BS: tl.constexpr, NBLK: tl.constexpr, EPS: tl.constexpr, QK_NORM: tl.constexpr):
    """Columns col0 + [0, cols) of both halves of q or k head `slot` ([B_PAD, *] float32 each; the whole
    head when QK_NORM): q/k-norm, RoPE at each row's position, stored to q or the k cache."""
    HALF: tl.constexpr = D // 2
    rb = tl.arange(0, B_PAD)
    pos = tl.load(positions + rb, mask=rb < n, other=0)
    dmask = rd < cols
    is_k = slot >= HQ
    if QK_NORM:
        rstd = tl.math.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / D + EPS)
        weight = qk_norm + (2 * layer + is_k) * D        # [layers, 2, D]: q_norm, k_norm
        lo = lo * rstd[:, None] * tl.load(weight + rd, mask=dmask).to(tl.float32)
        hi = hi * rstd[:, None] * tl.load(weight + HALF + rd, mask=dmask).to(tl.float32)
    angle = pos[:, None].to(tl.float32) * tl.load(inv_freq + col0 + rd, mask=dmask, other=0.0)[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    rotated_lo = lo * cos - hi * sin
    hi = hi * cos + lo * sin
    lo = rotated_lo
    if is_k:
        store_kv(k_cache, layer, slot - HQ, col0, cols, lo, hi, rb, rd, pos, n, block_table, D, HKV, MAXB, BS, NBLK)
    else:
        dst = q + (rb[:, None] * HQ + slot) * D + col0 + rd[None, :]
        mask = (rb < n)[:, None] & dmask[None, :]
        tl.store(dst, lo.to(q.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, hi.to(q.dtype.element_ty), mask=mask)


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def qkv_gpu(layer, head_slot, part, n, x, xs, wqkv, bqkv, qk_norm, inv_freq, positions, block_table, q,
            qk_raw, k_cache, v_cache, H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
            B_PAD: tl.constexpr, QKV_PARTS: tl.constexpr, QKV_BLOCK_N: tl.constexpr, MAXB: tl.constexpr,
            BS: tl.constexpr, NBLK: tl.constexpr, EPS: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr,
            NORM_BLOCK: tl.constexpr, QKV_BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, RAW_QK: tl.constexpr):
    # The two halves of the slice are separate accumulators, so rotate-half RoPE pairs columns elementwise.
    HALF: tl.constexpr = D // 2
    PART: tl.constexpr = HALF // QKV_PARTS
    rows: tl.constexpr = (HQ + 2 * HKV) * D
    slot = head_slot
    col0 = part * PART                                              # first column of the slice in each half
    w = wqkv + layer.to(tl.int64) * rows * H
    rstd = norm_rstd(x, n, H, EPS, B_PAD, NORM_BLOCK)[:, None]     # the input RMSNorm's scale
    lo, hi = matmul_pair(xs, w + col0 * H, w + (HALF + col0) * H, n, slot * D, PART, H, B_PAD, QKV_BLOCK_N,
                         QKV_BLOCK_K, DOT_PRECISION)
    lo, hi = lo * rstd, hi * rstd
    rd = tl.arange(0, QKV_BLOCK_N)
    dmask = rd < PART
    if HAS_BIAS:
        bias = bqkv + layer * rows + slot * D + col0
        lo += tl.load(bias + rd, mask=dmask, other=0.0).to(tl.float32)[None, :]
        hi += tl.load(bias + HALF + rd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    rb = tl.arange(0, B_PAD)
    if slot >= HQ + HKV:
        pos = tl.load(positions + rb, mask=rb < n, other=0)
        store_kv(v_cache, layer, slot - HQ - HKV, col0, PART, lo, hi, rb, rd, pos, n, block_table, D, HKV, MAXB, BS,
                 NBLK)
    elif RAW_QK:                                                  # attention finishes the head
        dst = qk_raw + (rb[:, None] * (HQ + HKV) + slot) * D + col0 + rd[None, :]
        mask = (rb < n)[:, None] & dmask[None, :]
        tl.store(dst, lo, mask=mask)
        tl.store(dst + HALF, hi, mask=mask)
    else:
        norm_rope_store(lo, hi, layer, slot, col0, PART, rd, n, qk_norm, inv_freq, positions, block_table, q,
                        k_cache, D, HQ, HKV, B_PAD, MAXB, BS, NBLK, EPS, QK_NORM)


@triton.jit
def qkv_prefetch(layer, head_slot, part, wqkv, H: tl.constexpr, D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr,
                 QKV_PARTS: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr):
    # a slice's weights are small and its phase leaves many workers idle: fetch up to 2x the usual amount
    # for each half
    rows: tl.constexpr = (HQ + 2 * HKV) * D
    PART: tl.constexpr = D // 2 // QKV_PARTS
    lo = wqkv + layer.to(tl.int64) * rows * H + (head_slot * D + part * PART) * H
    prefetch_l2(lo, head_slot * 0 + PART * H, 2 * PREFETCH, INTERPRET)
    prefetch_l2(lo + D // 2 * H, head_slot * 0 + PART * H, 2 * PREFETCH, INTERPRET)


@gluon.jit
def store_kv_ring(cache, layer, head, col0, cols, lo, hi, rd, rb, pos, n, block_table, D: gl.constexpr,
                  HKV: gl.constexpr, MAXB: gl.constexpr, BS: gl.constexpr, NBLK: gl.constexpr):
    """store_kv for the ring's [columns, rows] accumulators (rd, rb: their indices)."""
    rows = rb < n
    block = gl.load(block_table + rb * MAXB + pos // BS, mask=rows, other=0).to(gl.int64)
    base = (((layer.to(gl.int64) * NBLK + block) * BS + pos % BS) * HKV + head) * D + col0
    mask = (rd < cols)[:, None] & rows[None, :]
    act: gl.constexpr = cache.dtype.element_ty
    gl.store(cache + base[None, :] + rd[:, None], lo.to(act), mask=mask)
    gl.store(cache + base[None, :] + D // 2 + rd[:, None], hi.to(act), mask=mask)


@gluon.jit
def norm_rope_store_ring(lo, hi, layer, slot, col0, cols, rd, rb, n, qk_norm, inv_freq, positions, block_table, q,
                         k_cache, D: gl.constexpr, HQ: gl.constexpr, HKV: gl.constexpr, MAXB: gl.constexpr,
                         BS: gl.constexpr, NBLK: gl.constexpr, EPS: gl.constexpr, QK_NORM: gl.constexpr):
    """norm_rope_store for [columns, rows] halves; columns past `cols` may hold anything (masked here)."""
    HALF: gl.constexpr = D // 2
    pos = gl.load(positions + rb, mask=rb < n, other=0)
    dmask = rd < cols
    is_k = slot >= HQ
    if QK_NORM:
        lo = gl.where(dmask[:, None], lo, 0.0)
        hi = gl.where(dmask[:, None], hi, 0.0)
        rstd = gl.rsqrt((gl.sum(lo * lo, axis=0) + gl.sum(hi * hi, axis=0)) / D + EPS)
        weight = qk_norm + (2 * layer + is_k.to(gl.int32)) * D      # [layers, 2, D]: q_norm, k_norm
        lo = lo * rstd[None, :] * gl.load(weight + rd, mask=dmask, other=0.0).to(gl.float32)[:, None]
        hi = hi * rstd[None, :] * gl.load(weight + HALF + rd, mask=dmask, other=0.0).to(gl.float32)[:, None]
    angle = pos[None, :].to(gl.float32) * gl.load(inv_freq + col0 + rd, mask=dmask, other=0.0)[:, None]
    cos = gl.cos(angle)
    sin = gl.sin(angle)
    rotated_lo = lo * cos - hi * sin
    hi = hi * cos + lo * sin
    lo = rotated_lo
    if is_k:
        store_kv_ring(k_cache, layer, slot - HQ, col0, cols, lo, hi, rd, rb, pos, n, block_table, D, HKV, MAXB, BS,
                      NBLK)
    else:
        dst = q + (rb[None, :] * HQ + slot) * D + col0 + rd[:, None]
        mask = dmask[:, None] & (rb < n)[None, :]
        gl.store(dst, lo.to(q.dtype.element_ty), mask=mask)
        gl.store(dst + HALF, hi.to(q.dtype.element_ty), mask=mask)


@gluon.jit
def qkv_weights(layer, head_slot, part, wqkv_desc, ring, ready, empty, c, H: gl.constexpr, D: gl.constexpr,
                HQ: gl.constexpr, HKV: gl.constexpr, QKV_PARTS: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    PART: gl.constexpr = D // 2 // QKV_PARTS
    row = layer * (HQ + 2 * HKV) * D + head_slot * D + part * PART
    return rg.load_pair(wqkv_desc, row, row + D // 2, PART, H, ring, ready, empty, c, RING_INFLIGHT)


@gluon.jit
def qkv_ring(layer, head_slot, part, n, x, bqkv, qk_norm, inv_freq, positions, block_table, q, qk_raw, k_cache,
             v_cache, xs_desc, ring, ready, empty, xring, xready, c, cx, H: gl.constexpr, D: gl.constexpr,
             HQ: gl.constexpr, HKV: gl.constexpr, QKV_PARTS: gl.constexpr, MAXB: gl.constexpr, BS: gl.constexpr,
             NBLK: gl.constexpr, EPS: gl.constexpr, HAS_BIAS: gl.constexpr, QK_NORM: gl.constexpr,
             RAW_QK: gl.constexpr, num_warps: gl.constexpr):
    """qkv_gpu on the weight ring: the two halves of the slice share the slots of one block (load_pair), a
    half-empty slot each would halve the bytes in flight."""
    HALF: gl.constexpr = D // 2
    PART: gl.constexpr = HALF // QKV_PARTS
    slot = head_slot
    col0 = part * PART
    rg.prime_inputs(xs_desc, 0, H, xring, xready, cx)
    rstd = rg.norm_rstd(x, n, H, EPS, ring, xring, num_warps)          # the input RMSNorm's scale
    acc, c, cx = rg.mma_block(xs_desc, 0, H, ring, ready, empty, xring, xready, c, cx, True, False, num_warps)
    lo, hi, rd, rb = rg.split_halves(acc * rstd[None, :], ring, xring, num_warps)
    dmask = rd < PART
    if HAS_BIAS:
        bias = bqkv + layer * (HQ + 2 * HKV) * D + slot * D + col0
        lo += gl.load(bias + rd, mask=dmask, other=0.0).to(gl.float32)[:, None]
        hi += gl.load(bias + HALF + rd, mask=dmask, other=0.0).to(gl.float32)[:, None]
    if slot >= HQ + HKV:
        pos = gl.load(positions + rb, mask=rb < n, other=0)
        store_kv_ring(v_cache, layer, slot - HQ - HKV, col0, PART, lo, hi, rd, rb, pos, n, block_table, D, HKV, MAXB,
                      BS, NBLK)
    elif RAW_QK:                                                  # attention finishes the head
        dst = qk_raw + (rb[None, :] * (HQ + HKV) + slot) * D + col0 + rd[:, None]
        mask = dmask[:, None] & (rb < n)[None, :]
        gl.store(dst, lo, mask=mask)
        gl.store(dst + HALF, hi, mask=mask)
    else:
        norm_rope_store_ring(lo, hi, layer, slot, col0, PART, rd, rb, n, qk_norm, inv_freq, positions, block_table, q,
                             k_cache, D, HQ, HKV, MAXB, BS, NBLK, EPS, QK_NORM)
    return c, cx


class QKV(TaskKind):
    name = "qkv"
    # head_slot 0..hq-1: query heads, then hkv key heads, then hkv value heads (local); part of the graph's
    # qkv_parts (QKV_PARTS on the GPU): the columns [part, part + 1) * D / (2 * qkv_parts) of both halves
    args = ("head_slot", "part")
    gpu = qkv_gpu
    gpu_prefetch = qkv_prefetch
    ring = qkv_ring
    ring_weights = qkv_weights

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(shape.spec.head_dim // shape.qkv_parts, shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        (slot, part), parts = a, ctx.qkv_parts
        spec, plan, lw = ctx.spec, ctx.plan, ctx.weights.layers[layer]
        d, n = spec.head_dim, ctx.num_rows
        cols = slice_columns(d, part, parts)
        xs, rstd = normed_stream(ctx)
        out = (xs @ lw.wqkv[slot * d + cols].float().t()) * rstd
        if lw.bqkv is not None:
            out = out + lw.bqkv[slot * d + cols].float()
        if slot >= plan.num_heads + plan.num_kv_heads:
            store_kv_reference(ctx, ctx.v_cache, layer, slot - plan.num_heads - plan.num_kv_heads, cols,
                               out.to(ctx.dtype))
        elif raw_qk(ctx):                                         # attention finishes the head
            ctx.buf["qk_raw"][:n, slot, cols] = out
        else:
            norm_rope_store_reference(ctx, layer, slot, part, parts, out)


def slice_columns(d: int, part: int, parts: int) -> torch.Tensor:
    """The columns of part `part` of `parts` of a head of size d: the same slice of both halves."""
    width = d // 2 // parts
    return torch.cat([torch.arange(half + part * width, half + (part + 1) * width) for half in (0, d // 2)])


def raw_qk(ctx) -> bool:
    """Whether q and k heads leave QKV unnormalised (in qk_raw) for attention to finish: q/k-norm over slices."""
    return bool(ctx.spec.qk_norm) and ctx.qkv_parts > 1


def finish_heads(ctx, layer: int, is_q: bool, raw: torch.Tensor, positions: torch.Tensor,
                 inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """q/k-norm (where the model has it: whole heads) and RoPE of q or k heads raw [rows, heads, columns] (float32)
    at positions [rows], rounded once to the activation dtype, as q and the k cache hold them; inv_freq: the
    columns' frequencies (default: a whole head's)."""
    spec, lw = ctx.spec, ctx.weights.layers[layer]
    if spec.qk_norm:
        raw = rms_norm(raw, lw.q_norm if is_q else lw.k_norm, spec.rms_norm_eps)
    return rope(raw, positions, ctx.weights.inv_freq if inv_freq is None else inv_freq).to(ctx.dtype)


def norm_rope_store_reference(ctx, layer: int, slot: int, part: int, parts: int, out: torch.Tensor) -> None:
    """q/k-norm (whole heads: parts == 1), RoPE at each row's position and the store into q or the k cache
    of the float32 [rows, columns] `out` of part `part` of q or k head `slot`."""
    spec, plan = ctx.spec, ctx.plan
    n, width = ctx.num_rows, spec.head_dim // 2 // parts
    cols, pos = slice_columns(spec.head_dim, part, parts), ctx.positions[:n]
    is_q = slot < plan.num_heads
    out = finish_heads(ctx, layer, is_q, out[:, None, :], pos, ctx.weights.inv_freq[part * width:(part + 1) * width])
    out = out[:, 0]
    if is_q:
        ctx.buf["q"][:n, slot, cols] = out
    else:
        store_kv_reference(ctx, ctx.k_cache, layer, slot - plan.num_heads, cols, out)


def store_kv_reference(ctx, cache: torch.Tensor, layer: int, head: int, cols: torch.Tensor,
                       values: torch.Tensor) -> None:
    """Write columns `cols` of one head's [rows, columns] `values` at each row's position of the paged cache
    (store_kv's semantics)."""
    n = ctx.num_rows
    pos = ctx.positions[:n]
    blocks = ctx.block_table[torch.arange(n), pos // ctx.block_size]
    cache[layer, blocks[:, None], (pos % ctx.block_size)[:, None], head, cols] = values
