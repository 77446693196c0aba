"""A row tile of the attention output projection (row-parallel): attn @ Wo[rows]^T, into the residual
stream (tp=1) or this rank's partial sum (tp>1, combined by an allreduce task)."""
from distmk.tasks.base import TaskKind, row_parallel_tile


class OProj(TaskKind):
    name = "o_proj"
    args = ("row0", "nrows", "mode")

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.plan.num_heads * shape.spec.head_dim)

    def run(self, ctx, layer, a):
        row0, nrows, mode = a
        row_parallel_tile(ctx, ctx.buf["attn"], ctx.weights.layers[layer].wo, row0, nrows, mode)
