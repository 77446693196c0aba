"""Embedding lookup for one batch row: x[b] = E[token[b]]."""
from distmk.tasks.base import TaskKind


class Embed(TaskKind):
    name = "embed"
    args = ("row",)

    def cost(self, shape, layer, a):
        return 2 * shape.spec.hidden_size * shape.act_bytes

    def run(self, ctx, layer, a):
        (b,) = a
        if b < ctx.num_rows:
            ctx.buf["x"][b] = ctx.weights.embed[ctx.tokens[b]]
