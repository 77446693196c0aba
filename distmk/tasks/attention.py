"""Split-KV decode attention: for one row, one local KV head and one of S splits of the row's KV range,
the unnormalised partial output of the query heads that share that KV head, with its running max and
sum of exponentials (flash-decoding). The split bounds follow each row's position at run time, so one
table serves every context length; an empty split writes m=-inf, l=0, o=0. QKV leaves the q and k heads as the
projection gave them (tasks/qkv.py), so attention finishes them (finish_heads: q/k-norm, RoPE): its query heads,
and the keys of this step it reads (step_key_writers); the split that holds a row's own position stores the
row's finished key in the cache for the steps after."""
import math

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device.ring import cta_barrier, next_power_of_2, rows_layout
from distmk.tasks.base import TaskKind
from distmk.tasks.qkv import finish_heads


def kv_range(ctx, b: int) -> tuple[int, int]:
    """Positions [lo, hi) row b attends to: causal, and within the sliding window where the model has one."""
    hi = int(ctx.positions[b]) + 1
    window = ctx.spec.sliding_window
    return (max(0, hi - window) if window else 0), hi


def split_range(lo: int, hi: int, splits: int, s: int) -> tuple[int, int]:
    chunk = -(-(hi - lo) // splits)
    return min(hi, lo + s * chunk), min(hi, lo + (s + 1) * chunk)


@triton.jit
def _attend(qt, kt, vt, valid, m_i, l_i, acc, SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One block of keys kt and values vt ([keys, D], `valid` of them) into the running max, sum and output of the
    query heads qt."""
    scores = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION) * SCALE
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # probabilities stay float32 (exact fp32 product, as the reference computes p @ v)
    acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _step_key_writers(row, tt, valid, n, positions, block_table, B_PAD: tl.constexpr, MAXB: tl.constexpr,
                      BS: tl.constexpr):
    """step_key_writers for keys tt ([B_PAD] positions, `valid` of them): the row that computes each this step,
    or -1 (a key from the cache)."""
    rr = tl.arange(0, B_PAD)
    at = tl.load(positions + rr, mask=rr < n, other=-1)
    page_r = tl.load(block_table + rr * MAXB + at // BS, mask=rr < n, other=-1)
    page_t = tl.load(block_table + row * MAXB + tt // BS, mask=valid, other=-2)
    match = (at[None, :] == tt[:, None]) & (page_r[None, :] == page_t[:, None]) & valid[:, None]
    return tl.max(tl.where(match, rr[None, :], -1), axis=1)


@triton.jit
def norm_rope_rows(raw, row_offsets, pos, rd, weight, rope, mask, D: tl.constexpr, EPS: tl.constexpr,
                   QK_NORM: tl.constexpr):
    """finish_heads of whole heads: q/k-norm (QK_NORM, `weight` its weight) and rotate-half RoPE of the float32 rows
    at raw + row_offsets ([rows] element offsets) at positions pos [rows], float32. Each column's RoPE pair (column
    d +- D/2) is loaded beside it, and the angles' cosines and sines from the `rope` table (base.rope_table)."""
    HALF: tl.constexpr = D // 2
    pair = (rd + HALF) % D
    x = tl.load(raw + row_offsets[:, None] + rd[None, :], mask=mask[:, None], other=0.0)
    partner = tl.load(raw + row_offsets[:, None] + pair[None, :], mask=mask[:, None], other=0.0)
    if QK_NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + EPS)[:, None]
        x = x * rstd * tl.load(weight + rd).to(tl.float32)[None, :]
        partner = partner * rstd * tl.load(weight + pair).to(tl.float32)[None, :]
    at = rope + pos[:, None] * D + (rd % HALF)[None, :]
    cos = tl.load(at, mask=mask[:, None], other=0.0)
    sin = tl.load(at + HALF, mask=mask[:, None], other=0.0)
    return x * cos + tl.where((rd < HALF)[None, :], -partner, partner) * sin


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def attention_gpu(layer, row, kv_head, split, head0, n, qk_raw, qk_norm, rope, k_cache, v_cache, positions,
                  block_table, attn_o, attn_m, attn_l, attn, attn_count, D: tl.constexpr, HQ: tl.constexpr,
                  HKV: tl.constexpr, G: tl.constexpr, AH: tl.constexpr, AH_PAD: tl.constexpr, B_PAD: tl.constexpr,
                  MAXB: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr, S: tl.constexpr, WINDOW: tl.constexpr,
                  SCALE: tl.constexpr, EPS: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_T: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, BATCH: tl.constexpr, FUSED_ATTN_REDUCE: tl.constexpr):
    """The keys before the row's last n positions from the cache, a block at a time, then those (at most n, a block
    of B_PAD) from the cache or, where a row of this step computes them, from qk_raw. FUSED_ATTN_REDUCE: the
    split that ends its group last (by attn_count, acq_rel) combines it as attn_reduce would, in the same order."""
    if row < n:
        hi = tl.load(positions + row) + 1
        lo = hi * 0
        if WINDOW > 0:
            lo = tl.maximum(lo, hi - WINDOW)
        chunk = (hi - lo + S - 1) // S
        start = tl.minimum(hi, lo + split * chunk)
        stop = tl.minimum(hi, lo + (split + 1) * chunk)
        tail = tl.maximum(start, tl.minimum(stop, hi - n))
        rg = head0 + tl.arange(0, AH_PAD)       # the task's query heads of the group
        rd = tl.arange(0, D)
        rt = tl.arange(0, BLOCK_T)
        heads = rg < head0 + AH
        cache_layer = layer.to(tl.int64) * NBLK
        raw_q = (row * (HQ + HKV) + kv_head * G + rg) * D
        qt = norm_rope_rows(qk_raw, raw_q, rg * 0 + hi - 1, rd, qk_norm + 2 * layer * D, rope, heads, D, EPS,
                            QK_NORM).to(k_cache.dtype.element_ty)
        m_i = tl.full((AH_PAD,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((AH_PAD,), dtype=tl.float32)
        acc = tl.zeros((AH_PAD, D), dtype=tl.float32)
        for t0 in range(start, tail, BLOCK_T):
            t = t0 + rt
            valid = t < tail
            block = tl.load(block_table + row * MAXB + t // BS, mask=valid, other=0).to(tl.int64)
            base = (((cache_layer + block) * BS + t % BS) * HKV + kv_head) * D
            kt = tl.load(k_cache + base[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
            vt = tl.load(v_cache + base[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attend(qt, kt, vt, valid, m_i, l_i, acc, SCALE, DOT_PRECISION)
        if tail < stop:
            t = tail + tl.arange(0, B_PAD)
            valid = t < stop
            writer = _step_key_writers(row, t, valid, n, positions, block_table, B_PAD, MAXB, BS)
            block = tl.load(block_table + row * MAXB + t // BS, mask=valid, other=0).to(tl.int64)
            base = (((cache_layer + block) * BS + t % BS) * HKV + kv_head) * D
            raw_k = (tl.maximum(writer, 0) * (HQ + HKV) + HQ + kv_head) * D
            fresh = norm_rope_rows(qk_raw, raw_k, t, rd, qk_norm + (2 * layer + 1) * D, rope, writer >= 0, D, EPS,
                                   QK_NORM).to(k_cache.dtype.element_ty)
            cached = tl.load(k_cache + base[:, None] + rd[None, :], mask=(valid & (writer < 0))[:, None], other=0.0)
            kt = tl.where((writer >= 0)[:, None], fresh, cached)
            tl.store(k_cache + base[:, None] + rd[None, :], kt, mask=(writer == row)[:, None])   # for later steps
            vt = tl.load(v_cache + base[:, None] + rd[None, :], mask=valid[:, None], other=0.0)
            m_i, l_i, acc = _attend(qt, kt, vt, valid, m_i, l_i, acc, SCALE, DOT_PRECISION)
        part = (row * HKV + kv_head) * S + split
        tl.store(attn_o + (part * G + rg)[:, None] * D + rd[None, :], acc, mask=heads[:, None])
        tl.store(attn_m + part * G + rg, m_i, mask=heads)
        tl.store(attn_l + part * G + rg, l_i, mask=heads)
    if FUSED_ATTN_REDUCE:
        tl.debug_barrier()          # every thread's partials precede the count
        ended = tl.atomic_add(attn_count + ((layer * BATCH + row) * HKV + kv_head) * G + head0, 1, sem="acq_rel",
                              scope="gpu")
        if (ended + 1) % S == 0:    # acquired: the group's other splits' partials are visible
            attn_reduce_gpu(row, kv_head, head0, n, attn_o, attn_m, attn_l, attn, D, HQ, HKV, G, AH, AH_PAD, S)


@gluon.constexpr_function
def keys_per_thread(AH_PAD, RING_ATTN_KEYS):
    """Consecutive keys of a key slot that each of its threads holds: RING_ATTN_KEYS (a kernel option, 2 in a MoE
    kernel or one streaming e4m3 weights: kernels/interface.py), else 4, fewer where a task's heads are many (every
    thread holds heads x keys x 8 columns of the products; 8 heads at 4 keys spilled registers). Fewer keys a pass
    is less code (qwen3-30b-a3b's kernel: 143 KB at 4, 134 KB at 2) and more passes."""
    return RING_ATTN_KEYS or max(1, min(4, 16 // AH_PAD))


@gluon.constexpr_function
def attention_layout(D, AH_PAD, RING_ATTN_KEYS, num_warps):
    """[heads, key slots, keys of a slot, D] of the ring megakernel's attention: 16-byte vectors along D across the
    lanes, the rest of a warp and the warps over the key slots, a slot's keys and the task's heads in each thread. The
    reductions over D stay inside a warp and those over a slot's keys inside a thread."""
    lanes_d = max(1, min(32, D // 8))
    return gl.BlockedLayout([1, 1, keys_per_thread(AH_PAD, RING_ATTN_KEYS), 8], [1, 32 // lanes_d, 1, lanes_d],
                            [1, num_warps, 1, 1], [3, 2, 1, 0])


@gluon.constexpr_function
def attention_slots(D, num_warps):
    return 32 // max(1, min(32, D // 8)) * num_warps


@gluon.jit
def _key_blocks(block_table, row, t, stop, MAXB: gl.constexpr, BS: gl.constexpr):
    return gl.load(block_table + row * MAXB + t // BS, mask=t < stop, other=0)


@gluon.jit
def _key_rows(blocks, t, cache_layer, kv_head, HKV: gl.constexpr, D: gl.constexpr, BS: gl.constexpr):
    """Element offsets [slots, keys, 1] of keys t (in the pages `blocks`) of KV head kv_head."""
    return gl.expand_dims((((cache_layer + blocks.to(gl.int64)) * BS + t % BS) * HKV + kv_head) * D, 2)


@gluon.constexpr_function
def tail_layout(D, num_warps):
    """[heads, keys, D] of the ring attention's pass over this step's keys: a warp across D, the warps over
    the keys, so that RoPE's sines and cosines of those few keys are not computed in replica by every thread (a
    pass of the main layout holds 4 keys x 8 columns a thread: 64 calls each)."""
    return gl.BlockedLayout([1, 1, max(1, D // 32)], [1, 1, 32], [1, num_warps, 1], [2, 1, 0])


@gluon.jit
def rope_operands(raw, row_offsets, pos, rd, weight, rope, mask, D: gl.constexpr, QK_NORM: gl.constexpr):
    """The loads of norm_rope_rows in Gluon, to finish with finish_rope: row_offsets and pos in the rows' slice of
    the [rows, D] layout, rd in its columns'. Apart so that a task issues all of its loads before it reduces any (a
    round trip each otherwise). The table spares the kernel its sines and cosines: inlined, those of this function
    (libdevice's, with their slow path for huge angles) made the attention tasks several times slower and every
    other task slower too."""
    HALF: gl.constexpr = D // 2
    pair = (rd + HALF) % D
    x = gl.load(raw + row_offsets[:, None] + rd[None, :], mask=mask[:, None], other=0.0)
    partner = gl.load(raw + row_offsets[:, None] + pair[None, :], mask=mask[:, None], other=0.0)
    w = gl.full(rd.type.shape, 1.0, gl.float32, rd.type.layout)
    w_pair = w
    if QK_NORM:
        w = gl.load(weight + rd).to(gl.float32)
        w_pair = gl.load(weight + pair).to(gl.float32)
    at = rope + pos[:, None] * D + (rd % HALF)[None, :]
    cos = gl.load(at, mask=mask[:, None], other=0.0)
    sin = gl.load(at + HALF, mask=mask[:, None], other=0.0)
    return x, partner, w, w_pair, cos, sin


@gluon.jit
def finish_rope(operands, rd, D: gl.constexpr, EPS: gl.constexpr, QK_NORM: gl.constexpr):
    """norm_rope_rows' arithmetic on rope_operands' loads: q/k-norm (QK_NORM), then rotate-half RoPE."""
    x, partner, w, w_pair, cos, sin = operands
    if QK_NORM:
        rstd = gl.rsqrt(gl.sum(x * x, axis=1) / D + EPS)[:, None]
        x = x * rstd * w[None, :]
        partner = partner * rstd * w_pair[None, :]
    return x * cos + gl.where((rd < D // 2)[None, :], -partner, partner) * sin


@gluon.jit
def attention_prepare(layer, row, kv_head, split, n, k_cache, v_cache, positions, block_table, D: gl.constexpr,
                      HKV: gl.constexpr, AH: gl.constexpr, MAXB: gl.constexpr, BS: gl.constexpr, NBLK: gl.constexpr,
                      S: gl.constexpr, WINDOW: gl.constexpr, BATCH: gl.constexpr, RING_ATTN_KEYS: gl.constexpr,
                      num_warps: gl.constexpr):
    """What attention_ring reads before its event: the split's bounds, the page numbers of its first two passes
    and the first pass's keys and values. Nothing of it depends on this step's tasks but the keys at this step's own
    positions (at most n per row, the last n before hi: from `tail` on), which are a pass of their own: this finds
    which row computes each of them (step_key_writers) and loads those that are in the cache already."""
    AH_PAD: gl.constexpr = next_power_of_2(AH)
    R: gl.constexpr = keys_per_thread(AH_PAD, RING_ATTN_KEYS)
    SLOTS: gl.constexpr = attention_slots(D, num_warps)
    BLOCK: gl.constexpr = SLOTS * R
    l4: gl.constexpr = attention_layout(D, AH_PAD, RING_ATTN_KEYS, num_warps)
    lk: gl.constexpr = gl.SliceLayout(0, l4)
    hi = gl.load(positions + row, mask=row < n, other=-1) + 1          # a row past n: an empty range
    lo = hi * 0
    if WINDOW > 0:
        lo = gl.maximum(lo, hi - WINDOW)
    chunk = (hi - lo + S - 1) // S
    start = gl.minimum(hi, lo + split * chunk)
    stop = gl.minimum(hi, lo + (split + 1) * chunk)
    tail = gl.maximum(start, gl.minimum(stop, hi - n))
    tk = key_offsets(gl.SliceLayout(2, lk), SLOTS, R)
    first = _key_blocks(block_table, row, start + tk, tail, MAXB, BS)
    rows = _key_rows(first, start + tk, layer.to(gl.int64) * NBLK, kv_head, HKV, D, BS) + _columns(D, lk)
    valid = gl.expand_dims(start + tk < tail, 2)
    kt = gl.load(k_cache + rows, mask=valid, other=0.0)
    vt = gl.load(v_cache + rows, mask=valid, other=0.0)
    blocks = _key_blocks(block_table, row, start + BLOCK + tk, tail, MAXB, BS)
    TAIL: gl.constexpr = next_power_of_2(BATCH)
    lkt: gl.constexpr = gl.SliceLayout(0, tail_layout(D, num_warps))
    t = tail + gl.arange(0, TAIL, layout=gl.SliceLayout(1, lkt))
    page = _key_blocks(block_table, row, t, stop, MAXB, BS)
    writer = gl.full([TAIL], -1, gl.int32, layout=gl.SliceLayout(1, lkt))
    for r in gl.static_range(TAIL):
        at = gl.load(positions + r, mask=r < n, other=-1)
        page_r = gl.load(block_table + r * MAXB + at // BS, mask=r < n, other=-1)
        writer = gl.where((t == at) & (page == page_r) & (t < stop), r, writer)
    base = (((layer.to(gl.int64) * NBLK + page.to(gl.int64)) * BS + t % BS) * HKV + kv_head) * D
    rd = gl.arange(0, D, layout=gl.SliceLayout(0, lkt))
    cached = gl.load(k_cache + base[:, None] + rd[None, :], mask=((t < stop) & (writer < 0))[:, None], other=0.0)
    return hi, start, stop, kt, vt, blocks, tail, t, writer, base, cached


@gluon.jit
def key_offsets(layout: gl.constexpr, SLOTS: gl.constexpr, R: gl.constexpr):
    """[slots, keys] key offsets of one pass: slot-major, a slot's keys consecutive."""
    return (gl.expand_dims(gl.arange(0, SLOTS, layout=gl.SliceLayout(1, layout)), 1) * R
            + gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(0, layout)), 0))


@gluon.jit
def _columns(D: gl.constexpr, layout: gl.constexpr):
    """[1, 1, D] column offsets in the [slots, keys, D] layout."""
    return gl.expand_dims(gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(0, layout))), 0), 0)


@gluon.jit
def _step_keys_ring(layer, row, kv_head, head0, qk_raw, qk_norm, rope, k_cache, v_cache, prepared, D: gl.constexpr,
                    HQ: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, AH: gl.constexpr, EPS: gl.constexpr,
                    SCALE: gl.constexpr, QK_NORM: gl.constexpr, num_warps: gl.constexpr):
    """The row's query heads finished (finish_heads, [AH_PAD, D] in the tail layout's) and the pass over this step's
    keys [tail, stop) (tail_layout), those that rows of this step compute finished from qk_raw too, the row's own
    stored in the cache; returns the queries, and the pass's max, sum and output as one more slot."""
    AH_PAD: gl.constexpr = next_power_of_2(AH)
    lt: gl.constexpr = tail_layout(D, num_warps)
    lq: gl.constexpr = gl.SliceLayout(1, lt)            # [heads, D]
    lkt: gl.constexpr = gl.SliceLayout(0, lt)           # [keys, D]
    ls: gl.constexpr = gl.SliceLayout(2, lt)            # [heads, keys]
    hi, start, stop, kt, vt, blocks, tail, t, writer, base, cached = prepared
    rg = gl.arange(0, AH_PAD, layout=gl.SliceLayout(1, lq))
    rdq = gl.arange(0, D, layout=gl.SliceLayout(0, lq))
    q_rows = (row * (HQ + HKV) + kv_head * G + head0 + rg) * D
    # every load first (the split without this step's keys has them all masked off), then the arithmetic
    q_ops = rope_operands(qk_raw, q_rows, rg * 0 + hi - 1, rdq, qk_norm + 2 * layer * D, rope, rg < AH, D, QK_NORM)
    valid = t < stop
    rd = gl.arange(0, D, layout=gl.SliceLayout(0, lkt))
    offsets = base[:, None] + rd[None, :]
    v_step = gl.load(v_cache + offsets, mask=valid[:, None], other=0.0, cache_modifier=".cg")
    raw_k = (gl.maximum(writer, 0) * (HQ + HKV) + HQ + kv_head) * D
    k_ops = rope_operands(qk_raw, raw_k, t, rd, qk_norm + (2 * layer + 1) * D, rope, writer >= 0, D, QK_NORM)
    qt = finish_rope(q_ops, rdq, D, EPS, QK_NORM)
    qt = qt.to(k_cache.dtype.element_ty).to(gl.float32)              # rounded once, as finish_heads does
    fresh = finish_rope(k_ops, rd, D, EPS, QK_NORM).to(k_cache.dtype.element_ty)
    k_step = gl.where((writer >= 0)[:, None], fresh, cached)
    gl.store(k_cache + offsets, k_step, mask=(writer == row)[:, None])     # the row's own, for the later steps
    scores = gl.sum(gl.expand_dims(qt, 1) * gl.expand_dims(k_step.to(gl.float32), 0), axis=2) * SCALE
    scores = gl.where(gl.expand_dims(gl.convert_layout(valid, gl.SliceLayout(0, ls)), 0), scores, float("-inf"))
    m_t = gl.maximum(gl.max(scores, axis=1), -1.0e30)                # finite where the pass has no key
    p = gl.exp(scores - gl.expand_dims(m_t, 1))
    l_t = gl.sum(p, axis=1)
    acc_t = gl.sum(gl.expand_dims(p, 2) * gl.expand_dims(v_step.to(gl.float32), 0), axis=1)
    return qt, m_t, l_t, acc_t


@gluon.jit
def attention_ring(layer, row, kv_head, split, head0, n, qk_raw, qk_norm, rope, k_cache, v_cache, block_table,
                   attn_o, attn_m, attn_l, attn, attn_count, prepared, D: gl.constexpr, HQ: gl.constexpr,
                   HKV: gl.constexpr, G: gl.constexpr, AH: gl.constexpr, MAXB: gl.constexpr, BS: gl.constexpr,
                   NBLK: gl.constexpr, S: gl.constexpr, SCALE: gl.constexpr, EPS: gl.constexpr, QK_NORM: gl.constexpr,
                   RING_ATTN_KEYS: gl.constexpr, BATCH: gl.constexpr, FUSED_ATTN_REDUCE: gl.constexpr,
                   num_warps: gl.constexpr):
    """attention_gpu for the ring megakernel, shaped for latency: every key slot (attention_layout) is a split of
    its own, with its own running max and sum, so a pass over SLOTS x keys_per_thread keys needs no exchange
    between warps; the slots are combined once at the end. The first pass was loaded before the wait
    (attention_prepare), each next pass is loaded before the current one is computed, and the page numbers one
    pass further ahead. Products are float32 broadcast sums (Gluon has no tl.dot outside wgmma), so the query
    heads are padded to a power of two only. This step's keys are one more slot (_step_keys_ring), computed first.
    FUSED_ATTN_REDUCE: as attention_gpu's."""
    AH_PAD: gl.constexpr = next_power_of_2(AH)
    SLOTS: gl.constexpr = attention_slots(D, num_warps)
    R: gl.constexpr = keys_per_thread(AH_PAD, RING_ATTN_KEYS)
    BLOCK: gl.constexpr = SLOTS * R
    hi, start, stop, kt, vt, blocks, tail, _, _, _, _ = prepared
    if row < n:
        l4: gl.constexpr = attention_layout(D, AH_PAD, RING_ATTN_KEYS, num_warps)
        ls: gl.constexpr = gl.SliceLayout(3, l4)           # [heads, slots, keys]: scores
        lm: gl.constexpr = gl.SliceLayout(2, ls)           # [heads, slots]: running max and sum
        la: gl.constexpr = gl.SliceLayout(2, l4)           # [heads, slots, D]: running output
        lq: gl.constexpr = gl.SliceLayout(1, la)           # [heads, D]: queries, the output
        lk: gl.constexpr = gl.SliceLayout(0, l4)           # [slots, keys, D]: keys, values
        tk = key_offsets(gl.SliceLayout(2, lk), SLOTS, R)
        ts = key_offsets(gl.SliceLayout(0, ls), SLOTS, R)
        rdk = _columns(D, lk)
        cache_layer = layer.to(gl.int64) * NBLK
        rg = gl.arange(0, AH_PAD, layout=gl.SliceLayout(1, lq))
        rd = gl.arange(0, D, layout=gl.SliceLayout(0, lq))
        heads = rg < AH
        qt, m_t, l_t, acc_t = _step_keys_ring(layer, row, kv_head, head0, qk_raw, qk_norm, rope, k_cache, v_cache,
                                              prepared, D, HQ, HKV, G, AH, EPS, SCALE, QK_NORM, num_warps)
        q4 = gl.expand_dims(gl.expand_dims(gl.convert_layout(qt, lq), 1), 2)
        m_i = gl.full([AH_PAD, SLOTS], -1.0e30, gl.float32, layout=lm)   # finite: a slot may see no key in a pass
        l_i = gl.zeros([AH_PAD, SLOTS], gl.float32, layout=lm)
        acc = gl.zeros([AH_PAD, SLOTS, D], gl.float32, layout=la)
        for t0 in range(start, tail, BLOCK):
            t = t0 + BLOCK + tk
            rows = _key_rows(blocks, t, cache_layer, kv_head, HKV, D, BS) + rdk
            valid = gl.expand_dims(t < tail, 2)
            k_next = gl.load(k_cache + rows, mask=valid, other=0.0)
            v_next = gl.load(v_cache + rows, mask=valid, other=0.0)
            blocks = _key_blocks(block_table, row, t + BLOCK, tail, MAXB, BS)
            scores = gl.sum(q4 * gl.expand_dims(kt.to(gl.float32), 0), axis=3) * SCALE
            scores = gl.where(gl.expand_dims(t0 + ts < tail, 0), scores, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=2))
            alpha = gl.exp(m_i - m_new)
            p = gl.exp(scores - gl.expand_dims(m_new, 2))
            l_i = l_i * alpha + gl.sum(p, axis=2)
            pv = gl.sum(gl.expand_dims(p, 3) * gl.expand_dims(vt.to(gl.float32), 0), axis=2)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(2, la)), 2) + pv
            m_i = m_new
            kt = k_next
            vt = v_next
        m_t = gl.convert_layout(m_t, gl.SliceLayout(1, lm))
        mx = gl.maximum(gl.max(m_i, axis=1), m_t)
        weight = gl.exp(m_i - gl.expand_dims(mx, 1))
        w_t = gl.exp(m_t - mx)
        den = gl.sum(l_i * weight, axis=1) + gl.convert_layout(l_t, gl.SliceLayout(1, lm)) * w_t
        out = gl.sum(acc * gl.expand_dims(gl.convert_layout(weight, gl.SliceLayout(2, la)), 2), axis=1)
        out = out + gl.convert_layout(acc_t, lq) * gl.expand_dims(gl.convert_layout(w_t, gl.SliceLayout(1, lq)), 1)
        part = (row * HKV + kv_head) * S + split
        gl.store(attn_o + (part * G + head0 + rg)[:, None] * D + rd[None, :], out, mask=heads[:, None])
        rgm = gl.arange(0, AH_PAD, layout=gl.SliceLayout(1, lm))
        gl.store(attn_m + part * G + head0 + rgm, gl.where(den > 0, mx, float("-inf")), mask=rgm < AH)
        gl.store(attn_l + part * G + head0 + rgm, den, mask=rgm < AH)
    if FUSED_ATTN_REDUCE:
        cta_barrier()               # every thread's partials precede the count
        ended = gl.atomic_add(attn_count + ((layer * BATCH + row) * HKV + kv_head) * G + head0, 1, sem="acq_rel",
                              scope="gpu")
        if (ended + 1) % S == 0:    # acquired: the group's other splits' partials are visible
            attn_reduce_ring(row, kv_head, head0, n, attn_o, attn_m, attn_l, attn, D, HQ, HKV, G, AH, S, num_warps)


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def attn_reduce_gpu(row, kv_head, head0, n, attn_o, attn_m, attn_l, attn, D: tl.constexpr, HQ: tl.constexpr,
                    HKV: tl.constexpr, G: tl.constexpr, AH: tl.constexpr, AH_PAD: tl.constexpr, S: tl.constexpr):
    if row < n:
        rg = head0 + tl.arange(0, AH_PAD)
        rd = tl.arange(0, D)
        heads = rg < head0 + AH
        first = (row * HKV + kv_head) * S
        mx = tl.full((AH_PAD,), float("-inf"), dtype=tl.float32)
        for s in tl.static_range(S):
            mx = tl.maximum(mx, tl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0))
        num = tl.zeros((AH_PAD, D), dtype=tl.float32)
        den = tl.zeros((AH_PAD,), dtype=tl.float32)
        for s in tl.static_range(S):
            scale = tl.exp(tl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0) - mx)
            o = tl.load(attn_o + ((first + s) * G + rg)[:, None] * D + rd[None, :], mask=heads[:, None], other=0.0)
            num += o * scale[:, None]
            den += tl.load(attn_l + (first + s) * G + rg, mask=heads, other=1.0) * scale
        out = num / den[:, None]
        dst = attn + row * HQ * D + (kv_head * G + rg)[:, None] * D + rd[None, :]
        tl.store(dst, out.to(attn.dtype.element_ty), mask=heads[:, None])


@gluon.jit
def attn_reduce_ring(row, kv_head, head0, n, attn_o, attn_m, attn_l, attn, D: gl.constexpr, HQ: gl.constexpr,
                     HKV: gl.constexpr, G: gl.constexpr, AH: gl.constexpr, S: gl.constexpr, num_warps: gl.constexpr):
    AH_PAD: gl.constexpr = next_power_of_2(AH)
    if row < n:
        layout: gl.constexpr = rows_layout(num_warps)
        rg = head0 + gl.arange(0, AH_PAD, layout=gl.SliceLayout(1, layout))
        rd = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        heads = rg < head0 + AH
        first = (row * HKV + kv_head) * S
        mx = gl.full([AH_PAD], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
        for s in gl.static_range(S):
            mx = gl.maximum(mx, gl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0))
        num = gl.zeros([AH_PAD, D], gl.float32, layout=layout)
        den = gl.zeros([AH_PAD], gl.float32, layout=gl.SliceLayout(1, layout))
        for s in gl.static_range(S):
            scale = gl.exp(gl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0) - mx)
            o = gl.load(attn_o + ((first + s) * G + rg)[:, None] * D + rd[None, :], mask=heads[:, None], other=0.0)
            num += o * scale[:, None]
            den += gl.load(attn_l + (first + s) * G + rg, mask=heads, other=1.0) * scale
        out = num / den[:, None]
        dst = attn + row * HQ * D + (kv_head * G + rg)[:, None] * D + rd[None, :]
        gl.store(dst, out.to(attn.dtype.element_ty), mask=heads[:, None])


def combine_splits(ctx, b: int, kvh: int, h0: int) -> None:
    """attn_reduce's combine of row b's S partial outputs of KV head kvh's query heads from h0 (the reference's)."""
    if b >= ctx.num_rows:
        return
    g, d, heads = ctx.plan.group, ctx.spec.head_dim, attention_heads(ctx.plan.group)
    o, m, l = (ctx.buf[name][b, kvh, :, h0:h0 + heads] for name in ("attn_o", "attn_m", "attn_l"))  # [S,h,D],[S,h]
    mx = m.max(dim=0).values
    scale = torch.exp(m - mx)                                   # empty splits: exp(-inf) = 0
    out = (o * scale[..., None]).sum(0) / (l * scale).sum(0)[:, None]
    ctx.buf["attn"][b, (kvh * g + h0) * d:(kvh * g + h0 + heads) * d] = out.reshape(-1).to(ctx.dtype)


def attention_heads(group: int) -> int:
    """Query heads of a group that one attention task runs (head0 and on): the group, or 4 where it is a larger
    multiple of 4. A thread of the ring megakernel's attention holds each of its heads' products: groups of 8
    (qwen3-30b-a3b) spill registers and run far slower than groups of 4."""
    return 4 if group > 4 and group % 4 == 0 else group


class Attention(TaskKind):
    name = "attention"
    args = ("row", "kv_head", "split", "head0")     # head0: the first of its attention_heads query heads
    gpu = attention_gpu
    ring = attention_ring
    ring_prepare = attention_prepare

    def cost(self, shape, layer, a):
        d, g = shape.spec.head_dim, attention_heads(shape.plan.group)
        keys = -(-shape.context // shape.kv_splits)
        return 2 * keys * d * shape.act_bytes + 2 * g * d * shape.act_bytes + g * d * 4

    def run(self, ctx, layer, a):
        self.partials(ctx, layer, a)
        if ctx.fused_attn_reduce:       # the split that ends its group last combines it, as attention_gpu does
            b, kvh, _, h0 = a
            ended = ctx.buf["attn_count"][layer, b, kvh, h0]
            ended += 1
            if int(ended) % ctx.kv_splits == 0:
                combine_splits(ctx, b, kvh, h0)

    def partials(self, ctx, layer, a):
        b, kvh, s, h0 = a
        if b >= ctx.num_rows:
            return
        g, hq = ctx.plan.group, ctx.plan.num_heads
        heads = slice(h0, h0 + attention_heads(g))
        start, stop = split_range(*kv_range(ctx, b), ctx.kv_splits, s)
        o, m, l = ctx.buf["attn_o"], ctx.buf["attn_m"], ctx.buf["attn_l"]
        if start >= stop:
            o[b, kvh, s, heads] = 0.0
            m[b, kvh, s, heads] = -math.inf
            l[b, kvh, s, heads] = 0.0
            return
        t = torch.arange(start, stop)
        blocks = ctx.block_table[b, t // ctx.block_size]
        k = ctx.k_cache[layer, blocks, t % ctx.block_size, kvh].float()      # [T, D]
        v = ctx.v_cache[layer, blocks, t % ctx.block_size, kvh].float()
        raw, pos = ctx.buf["qk_raw"], ctx.positions
        q = finish_heads(ctx, layer, True, raw[b:b + 1, kvh * g + heads.start:kvh * g + heads.stop],
                         pos[b:b + 1])[0].float()                   # [heads, D]
        for key_pos, r in step_key_writers(ctx, b, start, stop).items():
            key = finish_heads(ctx, layer, False, raw[r:r + 1, hq + kvh:hq + kvh + 1], pos[r:r + 1])[0, 0]
            k[key_pos - start] = key.float()
            if r == b:                      # the row's own key, for the steps after this one
                ctx.k_cache[layer, blocks[key_pos - start], key_pos % ctx.block_size, kvh] = key
        scores = (q @ k.t()) * (1.0 / math.sqrt(ctx.spec.head_dim))         # [heads, T]
        mx = scores.max(dim=-1).values
        p = torch.exp(scores - mx[:, None])
        o[b, kvh, s, heads] = p @ v
        m[b, kvh, s, heads] = mx
        l[b, kvh, s, heads] = p.sum(-1)


def step_key_writers(ctx, b: int, start: int, stop: int) -> dict[int, int]:
    """The keys of [start, stop) that row b reads as this step computes them (they are not in the cache yet), by
    position: the row at that position whose block table holds the same page as row b's (the last such
    row). Only row b's last n positions are looked at: a step's rows of one sequence hold its last positions (a
    prompt's rows)."""
    bs, n = ctx.block_size, ctx.num_rows
    first = max(start, int(ctx.positions[b]) + 1 - n)
    writers = {}
    for r in range(n):
        t = int(ctx.positions[r])
        if first <= t < stop and ctx.block_table[r, t // bs] == ctx.block_table[b, t // bs]:
            writers[t] = r
    return writers
