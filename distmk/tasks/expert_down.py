"""A row tile of one routed expert's down projection, addressed by slot like expert_gate_up: if the slot is
the first to have chosen its expert, expert_h[slot] @ Wdown_e[rows]^T in float32 for every row that chose
the expert, stored at that row's own slot of expert_out (its k-th choice), where moe_combine weighs it.
Row-parallel: under tensor parallelism this rank's columns of the expert, a partial sum."""
import triton
import triton.language as tl

from distmk.device.primitives import matmul_block
from distmk.tasks.base import TaskKind
from distmk.tasks.route import leading_expert, slot_expert


# noinline: its shared memory is not added to the other tasks' (see tasks/router.py)
@triton.jit(noinline=True)
def expert_down_gpu(layer, slot, row0, nrows, sparse_layer, n, expert_h, expert_down, route_expert, route_slot,
                    expert_out, H: tl.constexpr, EXPERTS: tl.constexpr, EXPERT_INTER: tl.constexpr,
                    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BATCH: tl.constexpr, B_PAD: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    expert = slot_expert(slot, n, route_expert, route_slot, TOP_K)
    if expert >= 0:
        w = expert_down + (sparse_layer.to(tl.int64) * EXPERTS + expert) * H * EXPERT_INTER
        inp = expert_h + slot.to(tl.int64) * BATCH * EXPERT_INTER
        rb = tl.arange(0, B_PAD)
        rk = tl.arange(0, TOP_K_PAD)
        rn = tl.arange(0, BLOCK_N)
        # the rows whose choice this slot runs, and which of their choices it is
        mine = tl.load(route_slot + rb[:, None] * TOP_K + rk[None, :], mask=(rb < n)[:, None] & (rk < TOP_K)[None, :],
                       other=-1) == slot
        choice = tl.sum(tl.where(mine, rk[None, :], 0), axis=1)
        chose = tl.sum(mine.to(tl.int32), axis=1) > 0
        for j in range(0, nrows, BLOCK_N):
            acc = matmul_block(inp, w, n, row0 + j, nrows - j, EXPERT_INTER, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)
            offs = (rb * TOP_K + choice)[:, None] * H + (row0 + j + rn)[None, :]
            tl.store(expert_out + offs, acc, mask=chose[:, None] & (rn < nrows - j)[None, :])


class ExpertDown(TaskKind):
    name = "expert_down"
    args = ("slot", "row0", "nrows", "sparse_layer")
    gpu = expert_down_gpu

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[2], shape.plan.expert_inter)

    def run(self, ctx, layer, a):
        slot, row0, nrows, _ = a
        expert = leading_expert(ctx, slot)
        if expert is None:
            return
        n, w = ctx.num_rows, ctx.weights.layers[layer].expert_down[expert, row0:row0 + nrows]
        out = ctx.buf["expert_h"][slot, :n].float() @ w.float().t()
        rows, choices = (ctx.buf["route_slot"][:n] == slot).nonzero(as_tuple=True)
        ctx.buf["expert_out"][rows, choices, row0:row0 + nrows] = out[rows]
