"""Combine the S partial attention outputs of one row and KV head into the normalised output of its
query heads (those of the attention tasks it waits for: head0 and on, tasks/attention.py attention_heads):
out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max_s m_s."""
from distmk.tasks.attention import attention_heads, attn_reduce_gpu, attn_reduce_ring, combine_splits
from distmk.tasks.base import TaskKind


class AttnReduce(TaskKind):
    name = "attn_reduce"
    args = ("row", "kv_head", "head0")
    gpu = attn_reduce_gpu
    ring = attn_reduce_ring

    def cost(self, shape, layer, a):
        g, d = attention_heads(shape.plan.group), shape.spec.head_dim
        return shape.kv_splits * g * (d + 2) * 4 + g * d * shape.act_bytes

    def run(self, ctx, layer, a):
        combine_splits(ctx, *a)
