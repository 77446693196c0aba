"""A tile of the routed experts' down projections, cut at run time as expert_gate_up's tiles are: tile `part`
of `parts` runs its range of the step's distinct experts' output rows laid end to end (tasks/route.py), each
expert by its leading slot: expert_h[slot] @ Wdown_e[rows]^T in float32 for every row that chose the expert,
stored at that row's own slot of expert_out (its k-th choice), where moe_combine weighs it. Every tile reads
all of a slot's expert_h, so the down tiles wait for all of the layer's gate/up tiles. Row-parallel: under
tensor parallelism this rank's columns of each expert, a partial sum."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import layer_scales, matmul_block
from distmk.tasks.base import TaskKind
from distmk.tasks.route import (flat_range, flat_segment, flat_segments, load_routed_blocks, ring_flat_range,
                                ring_flat_segment, tile_rows_at_most)


# noinline: its shared memory is not added to the other tasks' (see tasks/router.py)
@triton.jit(noinline=True)
def expert_down_gpu(layer, part, parts, sparse_layer, n, expert_h, expert_down, expert_down_scale, route_expert,
                    route_slot, route_unique, route_count, expert_out, H: tl.constexpr, EXPERTS: tl.constexpr,
                    EXPERT_INTER: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BATCH: tl.constexpr,
                    B_PAD: tl.constexpr, EXPERT_BLOCK_N: tl.constexpr, EXPERT_BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    lo, hi, u0, u1 = flat_range(part, parts, route_count, H, TOP_K, BATCH)
    rb = tl.arange(0, B_PAD)
    rk = tl.arange(0, TOP_K_PAD)
    rn = tl.arange(0, EXPERT_BLOCK_N)
    for u in range(u0, u1):
        slot, expert, row0, nrows = flat_segment(u, lo, hi, route_unique, route_expert, H, BATCH)
        matrix = sparse_layer.to(tl.int64) * EXPERTS + expert
        w = expert_down + matrix * H * EXPERT_INTER
        scales = layer_scales(expert_down_scale, matrix, H, EXPERT_INTER)
        inp = expert_h + slot * BATCH * EXPERT_INTER
        # the rows whose choice this slot runs, and which of their choices it is
        mine = tl.load(route_slot + rb[:, None] * TOP_K + rk[None, :], mask=(rb < n)[:, None] & (rk < TOP_K)[None, :],
                       other=-1) == slot
        choice = tl.sum(tl.where(mine, rk[None, :], 0), axis=1)
        chose = tl.sum(mine.to(tl.int32), axis=1) > 0
        for j in range(0, nrows, EXPERT_BLOCK_N):
            acc = matmul_block(inp, w, n, row0 + j, nrows - j, EXPERT_INTER, B_PAD, EXPERT_BLOCK_N, EXPERT_BLOCK_K,
                               DOT_PRECISION, scales)
            offs = (rb * TOP_K + choice)[:, None] * H + (row0 + j + rn)[None, :]
            tl.store(expert_out + offs, acc, mask=chose[:, None] & (rn < nrows - j)[None, :])


@gluon.jit
def expert_down_weights(part, parts, sparse_layer, routed_count, route_unique, route_expert, expert_down_desc, ring,
                        ready, empty, c, H: gl.constexpr, EXPERTS: gl.constexpr, EXPERT_INTER: gl.constexpr,
                        TOP_K: gl.constexpr, BATCH: gl.constexpr, RING_INFLIGHT: gl.constexpr):
    return load_routed_blocks(part, parts, sparse_layer, routed_count, route_unique, route_expert, expert_down_desc,
                              expert_down_desc, False, H, EXPERT_INTER, EXPERTS, TOP_K, BATCH, ring, ready, empty,
                              c, RING_INFLIGHT)


@gluon.jit
def expert_down_ring(part, parts, sparse_layer, routed_count, n, route_unique, route_expert, route_slot, expert_out,
                     expert_down_scale, expert_down_desc, expert_h_desc, ring, ready, empty, xring, xready, c, cx,
                     H: gl.constexpr, EXPERTS: gl.constexpr, EXPERT_INTER: gl.constexpr, TOP_K: gl.constexpr,
                     BATCH: gl.constexpr, num_warps: gl.constexpr):
    """expert_down_gpu on the ring: a segment's blocks read its slot's rows of expert_h (a TMA box of the padded
    batch from row slot * BATCH: rows of other slots beyond n are computed and never stored)."""
    BN: gl.constexpr = ring.type.shape[1]
    lo, hi, u0, u1 = ring_flat_range(part, parts, routed_count, H, TOP_K, BATCH)
    rn, rb = rg.block_index(ring, xring, num_warps)
    for u in range(u0, u1):
        slot, expert, row0, nrows = ring_flat_segment(u, lo, hi, route_unique, route_expert, H, BATCH)
        scales = rg.layer_scales(expert_down_scale, sparse_layer * EXPERTS + expert, H, EXPERT_INTER)
        # the rows whose choice this slot runs, and which of their choices it is
        choice = gl.zeros_like(rb)
        chose = rb < 0
        for k in gl.static_range(TOP_K):
            mine = gl.load(route_slot + rb * TOP_K + k, mask=rb < n, other=-1) == slot
            choice = gl.where(mine, k, choice)
            chose = chose | mine
        for j in range(0, nrows, BN):
            acc, c, cx = rg.mma_rows(expert_down_desc, scales, row0 + j, nrows - j, expert_h_desc,
                                     (slot * BATCH).to(gl.int32), EXPERT_INTER, ring, ready, empty, xring, xready, c,
                                     cx, j > 0, j + BN < nrows, num_warps)
            offs = (rb * TOP_K + choice)[None, :] * H + (row0 + j + rn)[:, None]
            gl.store(expert_out + offs, acc, mask=(rn < nrows - j)[:, None] & chose[None, :])
    return c, cx


class ExpertDown(TaskKind):
    name = "expert_down"
    args = ("part", "parts", "sparse_layer", "routed")    # as expert_gate_up's
    gpu = expert_down_gpu
    ring = expert_down_ring
    ring_weights = expert_down_weights
    ring_routed = True

    def cost(self, shape, layer, a):
        rows = tile_rows_at_most(shape, a, shape.spec.hidden_size)
        return shape.matmul_bytes(rows, shape.plan.expert_inter)

    def run(self, ctx, layer, a):
        part, parts = a[:2]
        n, lw = ctx.num_rows, ctx.weights.layers[layer]
        for slot, expert, row0, nrows in flat_segments(ctx, part, parts, ctx.spec.hidden_size):
            out = ctx.buf["expert_h"][slot, :n].float() @ lw.expert_down[expert, row0:row0 + nrows].float().t()
            rows, choices = (ctx.buf["route_slot"][:n] == slot).nonzero(as_tuple=True)
            ctx.buf["expert_out"][rows, choices, row0:row0 + nrows] = out[rows]
