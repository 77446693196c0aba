"""A tile of the routed experts' down projections, cut at run time as expert_gate_up's tiles are: tile `part`
of `parts` runs its range of the step's distinct experts' output rows laid end to end (tasks/route.py), each
expert by its leading slot: expert_h[slot] @ Wdown_e[rows]^T in float32 for every row that chose the expert,
stored at that row's own slot of expert_out (its k-th choice), where moe_combine weighs it. Every tile reads
all of a slot's expert_h, so the down tiles wait for all of the layer's gate/up tiles. Row-parallel: under
tensor parallelism this rank's columns of each expert, a partial sum."""
import triton
import triton.language as tl

from distmk.device.primitives import matmul_block
from distmk.tasks.base import TaskKind
from distmk.tasks.route import flat_range, flat_segment, flat_segments, tile_rows_at_most


# noinline: its shared memory is not added to the other tasks' (see tasks/router.py)
@triton.jit(noinline=True)
def expert_down_gpu(layer, part, parts, sparse_layer, n, expert_h, expert_down, route_expert, route_slot,
                    route_unique, route_count, expert_out, H: tl.constexpr, EXPERTS: tl.constexpr,
                    EXPERT_INTER: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BATCH: tl.constexpr,
                    B_PAD: tl.constexpr, EXPERT_BLOCK_N: tl.constexpr, EXPERT_BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    lo, hi, u0, u1 = flat_range(part, parts, route_count, H, TOP_K, BATCH)
    rb = tl.arange(0, B_PAD)
    rk = tl.arange(0, TOP_K_PAD)
    rn = tl.arange(0, EXPERT_BLOCK_N)
    for u in range(u0, u1):
        slot, expert, row0, nrows = flat_segment(u, lo, hi, route_unique, route_expert, H, BATCH)
        w = expert_down + (sparse_layer.to(tl.int64) * EXPERTS + expert) * H * EXPERT_INTER
        inp = expert_h + slot * BATCH * EXPERT_INTER
        # the rows whose choice this slot runs, and which of their choices it is
        mine = tl.load(route_slot + rb[:, None] * TOP_K + rk[None, :], mask=(rb < n)[:, None] & (rk < TOP_K)[None, :],
                       other=-1) == slot
        choice = tl.sum(tl.where(mine, rk[None, :], 0), axis=1)
        chose = tl.sum(mine.to(tl.int32), axis=1) > 0
        for j in range(0, nrows, EXPERT_BLOCK_N):
            acc = matmul_block(inp, w, n, row0 + j, nrows - j, EXPERT_INTER, B_PAD, EXPERT_BLOCK_N, EXPERT_BLOCK_K,
                               DOT_PRECISION)
            offs = (rb * TOP_K + choice)[:, None] * H + (row0 + j + rn)[None, :]
            tl.store(expert_out + offs, acc, mask=chose[:, None] & (rn < nrows - j)[None, :])


class ExpertDown(TaskKind):
    name = "expert_down"
    args = ("part", "parts", "sparse_layer")    # tile `part` of the layer's `parts` (graph/lowering.py)
    gpu = expert_down_gpu

    def cost(self, shape, layer, a):
        rows = tile_rows_at_most(shape, a, shape.spec.hidden_size)
        return shape.matmul_bytes(rows, shape.plan.expert_inter)

    def run(self, ctx, layer, a):
        part, parts, _ = a
        n, lw = ctx.num_rows, ctx.weights.layers[layer]
        for slot, expert, row0, nrows in flat_segments(ctx, part, parts, ctx.spec.hidden_size):
            out = ctx.buf["expert_h"][slot, :n].float() @ lw.expert_down[expert, row0:row0 + nrows].float().t()
            rows, choices = (ctx.buf["route_slot"][:n] == slot).nonzero(as_tuple=True)
            ctx.buf["expert_out"][rows, choices, row0:row0 + nrows] = out[rows]
