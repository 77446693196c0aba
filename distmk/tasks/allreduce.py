"""All-reduce of one row tile of a row-parallel output: x[:, rows] += sum of every rank's partial, summed
in rank order so that all ranks hold bit-identical results. Waits only for the local matmul tile that
produced the slice; on the GPU the exchange goes through NVSHMEM symmetric memory."""
import torch

from distmk.tasks.base import TaskKind


class AllReduce(TaskKind):
    name = "allreduce"
    args = ("row0", "nrows", "slot")  # slot: which row-parallel output (2*layer for o_proj, 2*layer+1 for down)
    communicates = True

    def cost(self, shape, layer, a):
        # own partial out, every peer's partial in, residual read and written
        return shape.batch * a[1] * (4 * shape.plan.tp + 2 * shape.act_bytes)

    def run(self, ctx, layer, a):
        row0, nrows, _slot = a
        n, x = ctx.num_rows, ctx.buf["x"]
        parts = ctx.comm.gather(ctx.buf["partial"][:n, row0:row0 + nrows])
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        x[:n, row0:row0 + nrows] = (x[:n, row0:row0 + nrows].float() + total).to(x.dtype)
