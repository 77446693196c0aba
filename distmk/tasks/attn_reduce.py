"""Combine the S partial attention outputs of one row and KV head into the normalised output of its
query heads: out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s."""
import torch

from distmk.tasks.base import TaskKind


class AttnReduce(TaskKind):
    name = "attn_reduce"
    args = ("row", "kv_head")

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
