"""A row tile of the MLP down projection (row-parallel): h @ Wdown[rows]^T, into the residual stream
(tp=1) or this rank's partial sum (tp>1, combined by an allreduce task)."""
from distmk.tasks.base import TaskKind, row_parallel_tile


class Down(TaskKind):
    name = "down"
    args = ("row0", "nrows", "mode")

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[1], shape.plan.inter)

    def run(self, ctx, layer, a):
        row0, nrows, mode = a
        row_parallel_tile(ctx, ctx.buf["h"], ctx.weights.layers[layer].w_down, row0, nrows, mode)
