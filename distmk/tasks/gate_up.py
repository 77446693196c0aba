"""A row tile of the MLP's gate and up projections with the SiLU-gated product: h[:, rows] =
silu(xn @ Wgate[rows]^T) * (xn @ Wup[rows]^T). Column-parallel: no communication."""
import torch.nn.functional as F

from distmk.tasks.base import TaskKind


class GateUp(TaskKind):
    name = "gate_up"
    args = ("row0", "nrows")

    def cost(self, shape, layer, a):
        return 2 * shape.matmul_bytes(a[1], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        row0, nrows = a
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xn = ctx.buf["xn"][:n].float()
        gate = (xn @ lw.w_gate[row0:row0 + nrows].float().t()).to(ctx.dtype)
        up = (xn @ lw.w_up[row0:row0 + nrows].float().t()).to(ctx.dtype)
        ctx.buf["h"][:n, row0:row0 + nrows] = F.silu(gate) * up
