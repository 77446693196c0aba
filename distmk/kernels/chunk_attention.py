"""Attention of a prefill chunk over the paged KV cache, as one Triton kernel (and a combine where keys are split).

A chunk after a prompt's first (a cached prefix's suffix, a long prompt's later chunks) attends to every key before
its rows. Each program takes one kv head's query heads folded into its rows, a block of them, and reads the keys
of one part of the sequence straight from the cache's blocks through the page list: no gathered copy of the keys,
and no mask tensor, since a row sees key j iff j <= its position (and j > position - window). The keys past the
chunk's last position are not read at all, so a chunk's time follows its keys, not its bucket's. A short chunk
has few row blocks, so its keys are split into parts over more programs (flash-decoding), each writing its
normalised output and log-sum-exp, and a second kernel weighs the parts together.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_M = 64        # folded rows (query heads x rows) a program takes
BLOCK_N = 64        # keys an iteration reads
NUM_WARPS, NUM_STAGES = 4, 2


@triton.jit
def _attend(q_ptr, k_ptr, v_ptr, pages_ptr, pos_ptr, out_ptr, lse_ptr,
            stride_qr, stride_qh, stride_page, stride_slot, stride_kh, stride_or, stride_oh, stride_part,
            rows, heads, window, scale,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """Program (row block, kv head, part). Folded row m is row m // GROUP of query head kv_head * GROUP + m % GROUP.
    The rows' positions never decrease: the last row's keys are every part's.
    SPLIT: the part's output in float32 and its log-sum-exp (base 2; -inf where it saw no key), else the output
    itself. PRECISION: tl.dot's for float32 inputs (ieee where a float32 model is checked against transformers)."""
    kv_head, part = tl.program_id(1), tl.program_id(2)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row, head = m // GROUP, kv_head * GROUP + m % GROUP
    valid = row < rows
    dim = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr + row, mask=valid, other=0)
    q = tl.load(q_ptr + row[:, None] * stride_qr + head[:, None] * stride_qh + dim[None, :], mask=valid[:, None],
                other=0.0)
    seen_by_last = tl.load(pos_ptr + rows - 1) + 1          # the keys of the chunk's last row, split evenly
    keys_per_part = tl.cdiv(tl.cdiv(seen_by_last, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = part * keys_per_part
    hi = tl.minimum(lo + keys_per_part, tl.max(tl.where(valid, pos, 0)) + 1)
    if window > 0:
        lo = tl.maximum(lo, tl.min(tl.where(valid, pos, hi)) - window + 1)
    qk_scale = scale * 1.4426950408889634          # exp2 instead of exp
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key = start + tl.arange(0, BLOCK_N)
        inside = key < hi
        page = tl.load(pages_ptr + key // PAGE, mask=inside, other=0)
        at = page * stride_page + (key % PAGE) * stride_slot + kv_head * stride_kh
        k = tl.load(k_ptr + at[:, None] + dim[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + at[:, None] + dim[None, :], mask=inside[:, None], other=0.0)
        seen = (key[None, :] <= pos[:, None]) & inside[None, :]
        if window > 0:
            seen = seen & (key[None, :] > pos[:, None] - window)
        s = tl.where(seen, tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)        # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    at = part * stride_part + row[:, None] * stride_or + head[:, None] * stride_oh + dim[None, :]
    tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(lse_ptr + (part * rows + row) * heads + head, lse, mask=valid)


@triton.jit
def _combine(parts_ptr, lse_ptr, out_ptr, stride_part, stride_or, stride_oh, rows, heads,
             PARTS: tl.constexpr, GROUP: tl.constexpr, GROUP_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Program (row, kv head): its query heads' part outputs weighted by their share of each head's softmax, a part
    at a time (a short chunk may have hundreds of parts)."""
    row = tl.program_id(0)
    head = tl.program_id(1) * GROUP + tl.arange(0, GROUP_POW2)
    valid = tl.arange(0, GROUP_POW2) < GROUP
    dim = tl.arange(0, HEAD_DIM)
    lse_at = lse_ptr + row * heads + head
    top = tl.full([GROUP_POW2], float("-inf"), tl.float32)
    for part in range(PARTS):
        top = tl.maximum(top, tl.load(lse_at + part * rows * heads, mask=valid, other=0.0))
    total = tl.zeros([GROUP_POW2], tl.float32)
    acc = tl.zeros([GROUP_POW2, HEAD_DIM], tl.float32)
    at = parts_ptr + row * stride_or + head[:, None] * stride_oh + dim[None, :]
    for part in range(PARTS):
        weight = tl.exp2(tl.load(lse_at + part * rows * heads, mask=valid, other=0.0) - top)
        total += weight
        acc += weight[:, None] * tl.load(at + part * stride_part, mask=valid[:, None], other=0.0)
    tl.store(out_ptr + row * stride_or + head[:, None] * stride_oh + dim[None, :],
             (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])


def parts_for(rows: int, kv_heads: int, group: int, keys: int, programs: int) -> int:
    """How many parts to split `keys` into so that about `programs` programs run (a power of two, at least 1,
    and never parts shorter than BLOCK_N keys)."""
    blocks = kv_heads * -(-rows * group // BLOCK_M)
    parts = 1
    while blocks * parts * 2 <= programs and keys // (parts * 2) >= BLOCK_N:
        parts *= 2
    return parts


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
                    positions: torch.Tensor, keys: int, window: int | None = None,
                    parts: int | None = None) -> torch.Tensor:
    """[rows, heads, D] attention of the queries q ([rows, heads, D]; rows at `positions`, in order, their keys
    already written) over one layer's cache ([blocks, block_size, kv heads, D]) blocks `pages`. keys: the most
    the rows may see (sizes the split); parts: how many the keys are split into (default: parts_for the device's
    SMs)."""
    rows, heads, d = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("chunk_attention needs the head dimension contiguous and K and V laid out alike")
    if parts is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        parts = parts_for(rows, kv_heads, group, keys, 2 * sms)
    out = torch.empty(rows, heads, d, dtype=q.dtype, device=q.device)
    split = parts > 1
    target = torch.empty(parts, rows, heads, d, dtype=torch.float32, device=q.device) if split else out
    lse = torch.empty(parts, rows, heads, dtype=torch.float32, device=q.device) if split else out
    grid = (-(-rows * group // BLOCK_M), kv_heads, parts)
    _attend[grid](q, k_cache, v_cache, pages, positions, target, lse,
                  q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                  target.stride(-3), target.stride(-2), target.stride(0) if split else 0,
                  rows, heads, window or 0, 1 / math.sqrt(d),
                  GROUP=group, HEAD_DIM=d, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT=split,
                  PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=NUM_WARPS,
                  num_stages=NUM_STAGES)
    if split:
        _combine[(rows, kv_heads)](target, lse, out, target.stride(0), out.stride(0), out.stride(1), rows, heads,
                                   PARTS=parts, GROUP=group, GROUP_POW2=triton.next_power_of_2(group), HEAD_DIM=d)
    return out
