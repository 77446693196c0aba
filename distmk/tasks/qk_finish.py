"""The end of a q or k head whose QKV tiles were column slices under q/k-norm (Qwen3): the norm needs the
whole head, so the slices leave it unnormalised in qk_raw and this task normalises it, applies RoPE and
stores it to q or the k cache, exactly as a one-slice QKV tile would have (tasks/qkv.py)."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.tasks.base import TaskKind
from distmk.tasks.qkv import norm_rope_store, norm_rope_store_reference, norm_rope_store_ring


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def qk_finish_gpu(layer, head_slot, n, qk_raw, qk_norm, inv_freq, positions, block_table, q, k_cache, D: tl.constexpr,
                  HQ: tl.constexpr, HKV: tl.constexpr, B_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                  MAXB: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr, EPS: tl.constexpr,
                  QK_NORM: tl.constexpr):
    HALF: tl.constexpr = D // 2
    rb = tl.arange(0, B_PAD)
    rd = tl.arange(0, HALF_PAD)
    mask = (rb < n)[:, None] & (rd < HALF)[None, :]
    src = qk_raw + (rb[:, None] * (HQ + HKV) + head_slot) * D + rd[None, :]
    lo = tl.load(src, mask=mask, other=0.0)
    hi = tl.load(src + HALF, mask=mask, other=0.0)
    norm_rope_store(lo, hi, layer, head_slot, 0, HALF, rd, n, qk_norm, inv_freq, positions, block_table, q, k_cache,
                    D, HQ, HKV, B_PAD, MAXB, BS, NBLK, EPS, QK_NORM)


@gluon.jit
def qk_finish_ring(layer, head_slot, n, qk_raw, qk_norm, inv_freq, positions, block_table, q, k_cache, D: gl.constexpr,
                   HQ: gl.constexpr, HKV: gl.constexpr, B_PAD: gl.constexpr, HALF_PAD: gl.constexpr,
                   MAXB: gl.constexpr, BS: gl.constexpr, NBLK: gl.constexpr, EPS: gl.constexpr,
                   QK_NORM: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = D // 2
    # lanes down the head's columns, no replicas: rows_layout's 128 columns across a warp held this [64, 16] tile
    # eightfold, and ptxas spilled 1 KB of the whole kernel's registers for it
    layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, num_warps], [0, 1])
    rd = gl.arange(0, HALF_PAD, layout=gl.SliceLayout(1, layout))      # the ring's [columns, rows] orientation
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(0, layout))
    mask = (rd < HALF)[:, None] & (rb < n)[None, :]
    src = qk_raw + (rb[None, :] * (HQ + HKV) + head_slot) * D + rd[:, None]
    lo = gl.load(src, mask=mask, other=0.0)
    hi = gl.load(src + HALF, mask=mask, other=0.0)
    norm_rope_store_ring(lo, hi, layer, head_slot, 0, HALF, rd, rb, n, qk_norm, inv_freq, positions, block_table, q,
                         k_cache, D, HQ, HKV, MAXB, BS, NBLK, EPS, QK_NORM)


class QKFinish(TaskKind):
    name = "qk_finish"
    args = ("head_slot",)        # 0..hq-1: query heads, then hkv key heads (local)
    gpu = qk_finish_gpu
    ring = qk_finish_ring

    def cost(self, shape, layer, a):
        return shape.batch * shape.spec.head_dim * (4 + shape.act_bytes)

    def run(self, ctx, layer, a):
        (slot,) = a
        norm_rope_store_reference(ctx, layer, slot, 0, 1, ctx.buf["qk_raw"][:ctx.num_rows, slot])
