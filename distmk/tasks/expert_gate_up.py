"""A row tile of one routed expert's gate and up projections with the SiLU-gated product, addressed by slot
(tasks/route.py): if the slot is the first to have chosen its expert this step, expert_h[slot, :, rows] =
silu(xn @ Wgate_e[rows]^T) * (xn @ Wup_e[rows]^T) for every row, in float32, rounded once (xn: the
post-attention RMSNorm of the residual stream, by each tile). Which expert's weights stream follows the
route task's output; the rows that did not choose it are computed alongside (the weights dominate) and never
combined. Column-parallel, as the dense gate_up: this rank's rows of the expert."""
import torch
import triton
import triton.language as tl

from distmk.device.primitives import matmul_pair, rms_norm_rows
from distmk.tasks.base import TaskKind, normed_stream
from distmk.tasks.route import leading_expert, slot_expert


# noinline: its shared memory is not added to the other tasks' (see tasks/router.py)
@triton.jit(noinline=True)
def expert_gate_up_gpu(layer, slot, row0, nrows, sparse_layer, n, worker, x, xn, norms, expert_gate, expert_up,
                       route_expert, route_slot, expert_h, H: tl.constexpr, EXPERTS: tl.constexpr,
                       EXPERT_INTER: tl.constexpr, TOP_K: tl.constexpr, BATCH: tl.constexpr, B_PAD: tl.constexpr,
                       EPS: tl.constexpr, NORM_BLOCK: tl.constexpr, MLP_BLOCK_N: tl.constexpr,
                       MLP_BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    expert = slot_expert(slot, n, route_expert, route_slot, TOP_K)
    if expert >= 0:
        offset = (sparse_layer.to(tl.int64) * EXPERTS + expert) * EXPERT_INTER * H
        out = expert_h + slot.to(tl.int64) * BATCH * EXPERT_INTER
        act = expert_h.dtype.element_ty
        rb = tl.arange(0, B_PAD)
        rn = tl.arange(0, MLP_BLOCK_N)
        inp = xn + worker * B_PAD * H
        rms_norm_rows(x, n, norms + (2 * layer + 1) * H, inp, H, EPS, NORM_BLOCK)
        for j in range(0, nrows, MLP_BLOCK_N):
            gate, up = matmul_pair(inp, expert_gate + offset, expert_up + offset, n, row0 + j, nrows - j, H, B_PAD,
                                   MLP_BLOCK_N, MLP_BLOCK_K, DOT_PRECISION)
            mask = (rb < n)[:, None] & (rn < nrows - j)[None, :]
            tl.store(out + rb[:, None] * EXPERT_INTER + (row0 + j + rn)[None, :],
                     (gate * tl.sigmoid(gate) * up).to(act), mask=mask)


class ExpertGateUp(TaskKind):
    name = "expert_gate_up"
    args = ("slot", "row0", "nrows", "sparse_layer")
    gpu = expert_gate_up_gpu

    def cost(self, shape, layer, a):
        return 2 * shape.matmul_bytes(a[2], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        slot, row0, nrows, _ = a
        expert = leading_expert(ctx, slot)
        if expert is None:
            return
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xn = normed_stream(ctx, lw.post_norm).float()
        gate = xn @ lw.expert_gate[expert, row0:row0 + nrows].float().t()
        up = xn @ lw.expert_up[expert, row0:row0 + nrows].float().t()
        ctx.buf["expert_h"][slot, :n, row0:row0 + nrows] = (gate * torch.sigmoid(gate) * up).to(ctx.dtype)
