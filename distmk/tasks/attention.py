"""Split-KV decode attention: for one row, one local KV head and one of S splits of the row's KV range,
the unnormalised partial output of the query heads that share that KV head, with its running max and
sum of exponentials (flash-decoding). The split bounds follow each row's position at run time, so one
table serves every context length; an empty split writes m=-inf, l=0, o=0."""
import math

import torch

from distmk.tasks.base import TaskKind


def kv_range(ctx, b: int) -> tuple[int, int]:
    """Positions [lo, hi) row b attends to: causal, and within the sliding window where the model has one."""
    hi = int(ctx.positions[b]) + 1
    window = ctx.spec.sliding_window
    return (max(0, hi - window) if window else 0), hi


def split_range(lo: int, hi: int, splits: int, s: int) -> tuple[int, int]:
    chunk = -(-(hi - lo) // splits)
    return min(hi, lo + s * chunk), min(hi, lo + (s + 1) * chunk)


class Attention(TaskKind):
    name = "attention"
    args = ("row", "kv_head", "split")

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
