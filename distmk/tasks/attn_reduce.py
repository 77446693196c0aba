"""Combine the S partial attention outputs of one row and KV head into the normalised output of its
query heads (those of the attention tasks it waits for: head0 and on, tasks/attention.py attention_heads):
out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device.ring import next_power_of_2, rows_layout
from distmk.tasks.attention import attention_heads
from distmk.tasks.base import TaskKind


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


class AttnReduce(TaskKind):
    name = "attn_reduce"
    args = ("row", "kv_head", "head0")
    gpu = attn_reduce_gpu
    ring = attn_reduce_ring

    def cost(self, shape, layer, a):
        g, d = attention_heads(shape.plan.group), shape.spec.head_dim
        return shape.kv_splits * g * (d + 2) * 4 + g * d * shape.act_bytes

    def run(self, ctx, layer, a):
        b, kvh, h0 = a
        if b >= ctx.num_rows:
            return
        g, d, heads = ctx.plan.group, ctx.spec.head_dim, attention_heads(ctx.plan.group)
        o, m, l = (ctx.buf[name][b, kvh, :, h0:h0 + heads] for name in ("attn_o", "attn_m", "attn_l"))  # [S,h,D],[S,h]
        mx = m.max(dim=0).values
        scale = torch.exp(m - mx)                                   # empty splits: exp(-inf) = 0
        out = (o * scale[..., None]).sum(0) / (l * scale).sum(0)[:, None]
        ctx.buf["attn"][b, (kvh * g + h0) * d:(kvh * g + h0 + heads) * d] = out.reshape(-1).to(ctx.dtype)
