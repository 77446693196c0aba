"""Combine the S partial attention outputs of one row and KV head into the normalised output of its
query heads: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device.ring import next_power_of_2, rows_layout
from distmk.tasks.base import TaskKind


# noinline: see TaskKind.gpu (tasks/base.py)
@triton.jit(noinline=True)
def attn_reduce_gpu(row, kv_head, n, attn_o, attn_m, attn_l, attn, D: tl.constexpr, HQ: tl.constexpr,
                    HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, S: tl.constexpr):
    if row < n:
        rg = tl.arange(0, G_PAD)
        rd = tl.arange(0, D)
        heads = rg < G
        first = (row * HKV + kv_head) * S
        mx = tl.full((G_PAD,), float("-inf"), dtype=tl.float32)
        for s in tl.static_range(S):
            mx = tl.maximum(mx, tl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0))
        num = tl.zeros((G_PAD, D), dtype=tl.float32)
        den = tl.zeros((G_PAD,), dtype=tl.float32)
        for s in tl.static_range(S):
            scale = tl.exp(tl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0) - mx)
            o = tl.load(attn_o + ((first + s) * G + rg)[:, None] * D + rd[None, :], mask=heads[:, None], other=0.0)
            num += o * scale[:, None]
            den += tl.load(attn_l + (first + s) * G + rg, mask=heads, other=1.0) * scale
        out = num / den[:, None]
        dst = attn + row * HQ * D + (kv_head * G + rg)[:, None] * D + rd[None, :]
        tl.store(dst, out.to(attn.dtype.element_ty), mask=heads[:, None])


@gluon.jit
def attn_reduce_ring(row, kv_head, n, attn_o, attn_m, attn_l, attn, D: gl.constexpr, HQ: gl.constexpr,
                     HKV: gl.constexpr, G: gl.constexpr, S: gl.constexpr, num_warps: gl.constexpr):
    G_PAD: gl.constexpr = next_power_of_2(G)
    if row < n:
        layout: gl.constexpr = rows_layout(num_warps)
        rg = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, layout))
        rd = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        heads = rg < G
        first = (row * HKV + kv_head) * S
        mx = gl.full([G_PAD], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
        for s in gl.static_range(S):
            mx = gl.maximum(mx, gl.load(attn_m + (first + s) * G + rg, mask=heads, other=0.0))
        num = gl.zeros([G_PAD, D], gl.float32, layout=layout)
        den = gl.zeros([G_PAD], gl.float32, layout=gl.SliceLayout(1, layout))
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
    args = ("row", "kv_head")
    gpu = attn_reduce_gpu
    ring = attn_reduce_ring

    def cost(self, shape, layer, a):
        g, d = shape.plan.group, shape.spec.head_dim
        return shape.kv_splits * g * (d + 2) * 4 + g * d * shape.act_bytes

    def run(self, ctx, layer, a):
        b, kvh = a
        if b >= ctx.num_rows:
            return
        g, d = ctx.plan.group, ctx.spec.head_dim
        o, m, l = ctx.buf["attn_o"][b, kvh], ctx.buf["attn_m"][b, kvh], ctx.buf["attn_l"][b, kvh]  # [S,g,D],[S,g]
        mx = m.max(dim=0).values
        scale = torch.exp(m - mx)                                   # empty splits: exp(-inf) = 0
        out = (o * scale[..., None]).sum(0) / (l * scale).sum(0)[:, None]
        ctx.buf["attn"][b, kvh * g * d:(kvh + 1) * g * d] = out.reshape(-1).to(ctx.dtype)
