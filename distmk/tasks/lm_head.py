"""A row tile of the vocab-parallel lm_head: logits for this rank's vocabulary rows, plus the tile's
argmax per batch row (first index on ties; padding rows past the vocabulary never win)."""
import math

import torch

from distmk.tasks.base import TaskKind


class LMHead(TaskKind):
    name = "lm_head"
    args = ("row0", "nrows", "tile")

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        row0, nrows, tile = a
        n = ctx.num_rows
        logits = ctx.buf["xn"][:n].float() @ ctx.weights.lm_head[row0:row0 + nrows].float().t()
        ctx.buf["logits"][:n, row0:row0 + nrows] = logits
        valid = max(0, min(nrows, ctx.plan.vocab_valid - row0))
        if valid == 0:
            ctx.buf["tile_max"][:n, tile] = -math.inf
            ctx.buf["tile_arg"][:n, tile] = -1
            return
        mx, arg = logits[:, :valid].max(dim=-1)
        ctx.buf["tile_max"][:n, tile] = mx
        ctx.buf["tile_arg"][:n, tile] = arg + ctx.plan.vocab0 + row0
