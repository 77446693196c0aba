"""A row tile of the MLP's gate and up projections with the SiLU-gated product: h[:, rows] =
silu(xn @ Wgate[rows]^T) * (xn @ Wup[rows]^T). Column-parallel: no communication."""
import torch.nn.functional as F
import triton
import triton.language as tl

from distmk.kernels.primitives import matmul_block
from distmk.tasks.base import TaskKind


@triton.jit
def gate_up_gpu(layer, a0, a1, n, xn, w_gate, w_up, h, H: tl.constexpr, INTER: tl.constexpr,
                B_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offset = layer.to(tl.int64) * INTER * H
    act = h.dtype.element_ty
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    for j in range(0, a1, BLOCK_N):
        gate = matmul_block(xn, w_gate + offset, n, a0 + j, a1 - j, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)
        up = matmul_block(xn, w_up + offset, n, a0 + j, a1 - j, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)
        gate = gate.to(act).to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(act).to(tl.float32)
        mask = (rb < n)[:, None] & (rn < a1 - j)[None, :]
        tl.store(h + rb[:, None] * INTER + (a0 + j + rn)[None, :], (silu * up.to(act).to(tl.float32)).to(act),
                 mask=mask)


class GateUp(TaskKind):
    name = "gate_up"
    args = ("row0", "nrows")
    gpu = gate_up_gpu

    def cost(self, shape, layer, a):
        return 2 * shape.matmul_bytes(a[1], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        row0, nrows = a
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xn = ctx.buf["xn"][:n].float()
        gate = (xn @ lw.w_gate[row0:row0 + nrows].float().t()).to(ctx.dtype)
        up = (xn @ lw.w_up[row0:row0 + nrows].float().t()).to(ctx.dtype)
        ctx.buf["h"][:n, row0:row0 + nrows] = F.silu(gate) * up
