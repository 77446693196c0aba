"""A tile of the routed experts' gate and up projections with the SiLU-gated product. The step's distinct
experts' rows, laid end to end (route_unique's order, tasks/route.py), are cut evenly over the layer's tiles
at run time: tile `part` of `parts` runs its range of them, a piece of one expert or of two or more, each
expert by its leading slot: expert_h[slot, :, rows] = silu(xn @ Wgate_e[rows]^T) * (xn @ Wup_e[rows]^T) for
every row, in float32, rounded once (xn: the post-attention RMSNorm of the residual stream, tasks/base.py
normed_stream). Rows that choose the same expert share one stream of its weights, and however many do, every
tile streams about the same bytes (tiles fixed to a slot left most of them idle at batch 8, where slots share
experts); the rows that did not choose an expert are computed alongside (the weights dominate) and never
combined. Column-parallel, as the dense gate_up: this rank's rows of each expert."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.device.primitives import layer_scales, matmul_pair, norm_rstd
from distmk.tasks.base import TaskKind, normed_stream
from distmk.tasks.route import (flat_range, flat_segment, flat_segments, load_routed_blocks, ring_flat_range,
                                ring_flat_segment, tile_rows_at_most)


# noinline: its shared memory is not added to the other tasks' (see tasks/router.py)
@triton.jit(noinline=True)
def expert_gate_up_gpu(part, parts, sparse_layer, n, x, xs, expert_gate, expert_up, expert_gate_scale,
                       expert_up_scale, route_expert, route_unique, route_count, expert_h, H: tl.constexpr,
                       EXPERTS: tl.constexpr,
                       EXPERT_INTER: tl.constexpr, TOP_K: tl.constexpr, BATCH: tl.constexpr, B_PAD: tl.constexpr,
                       EPS: tl.constexpr, NORM_BLOCK: tl.constexpr, MLP_BLOCK_N: tl.constexpr,
                       MLP_BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    lo, hi, u0, u1 = flat_range(part, parts, route_count, EXPERT_INTER, TOP_K, BATCH)
    if lo < hi:
        act = expert_h.dtype.element_ty
        rb = tl.arange(0, B_PAD)
        rn = tl.arange(0, MLP_BLOCK_N)
        rstd = norm_rstd(x, n, H, EPS, B_PAD, NORM_BLOCK)[:, None]     # the post-attention RMSNorm's scale
        for u in range(u0, u1):
            slot, expert, row0, nrows = flat_segment(u, lo, hi, route_unique, route_expert, EXPERT_INTER, BATCH)
            matrix = sparse_layer.to(tl.int64) * EXPERTS + expert
            offset = matrix * EXPERT_INTER * H
            out = expert_h + slot * BATCH * EXPERT_INTER
            for j in range(0, nrows, MLP_BLOCK_N):
                gate, up = matmul_pair(xs, expert_gate + offset, expert_up + offset, n, row0 + j, nrows - j, H,
                                       B_PAD, MLP_BLOCK_N, MLP_BLOCK_K, DOT_PRECISION,
                                       layer_scales(expert_gate_scale, matrix, EXPERT_INTER, H),
                                       layer_scales(expert_up_scale, matrix, EXPERT_INTER, H))
                gate, up = gate * rstd, up * rstd
                mask = (rb < n)[:, None] & (rn < nrows - j)[None, :]
                tl.store(out + rb[:, None] * EXPERT_INTER + (row0 + j + rn)[None, :],
                         (gate * tl.sigmoid(gate) * up).to(act), mask=mask)


@gluon.jit
def expert_gate_up_weights(part, parts, sparse_layer, routed_count, route_unique, route_expert, expert_gate_desc,
                           expert_up_desc, ring, ready, empty, c, H: gl.constexpr, EXPERTS: gl.constexpr,
                           EXPERT_INTER: gl.constexpr, TOP_K: gl.constexpr, BATCH: gl.constexpr,
                           RING_INFLIGHT: gl.constexpr):
    # a block of gate rows, then the same rows of up (gate_up_weights)
    return load_routed_blocks(part, parts, sparse_layer, routed_count, route_unique, route_expert, expert_gate_desc,
                              expert_up_desc, True, EXPERT_INTER, H, EXPERTS, TOP_K, BATCH, ring, ready, empty,
                              c, RING_INFLIGHT)


@gluon.jit
def expert_gate_up_ring(part, parts, sparse_layer, routed_count, n, x, route_unique, route_expert, expert_h,
                        expert_gate_scale, expert_up_scale, expert_gate_desc, expert_up_desc, xs_desc, ring, ready,
                        empty, xring, xready, c, cx, H: gl.constexpr, EXPERTS: gl.constexpr,
                        EXPERT_INTER: gl.constexpr, TOP_K: gl.constexpr, BATCH: gl.constexpr, EPS: gl.constexpr,
                        num_warps: gl.constexpr):
    """gate_up_ring over the tile's segments; every block reads the same input, so each goes on issuing the next
    one's first input slices (mma_block's chaining), across segments too."""
    BN: gl.constexpr = ring.type.shape[1]
    lo, hi, u0, u1 = ring_flat_range(part, parts, routed_count, EXPERT_INTER, TOP_K, BATCH)
    if lo < hi:         # inputs are primed only for a tile that has blocks: none may be left unconsumed
        rg.prime_inputs(xs_desc, 0, H, xring, xready, cx)
        rstd = rg.norm_rstd(x, n, H, EPS, ring, xring, num_warps)[None, :]     # the post-attention RMSNorm's scale
        rn, rb = rg.block_index(ring, xring, num_warps)
        for u in range(u0, u1):
            slot, expert, row0, nrows = ring_flat_segment(u, lo, hi, route_unique, route_expert, EXPERT_INTER,
                                                          BATCH)
            out = expert_h + slot * BATCH * EXPERT_INTER
            gate_scales = rg.layer_scales(expert_gate_scale, sparse_layer * EXPERTS + expert, EXPERT_INTER, H)
            up_scales = rg.layer_scales(expert_up_scale, sparse_layer * EXPERTS + expert, EXPERT_INTER, H)
            for j in range(0, nrows, BN):
                more = (j + BN < nrows) | (u + 1 < u1)
                gate, up, c, cx = rg.gate_and_up(expert_gate_desc, expert_up_desc, gate_scales, up_scales, row0 + j,
                                                 nrows - j, xs_desc, H, ring, ready, empty, xring, xready, c, cx, more,
                                                 num_warps)
                gate, up = gate * rstd, up * rstd
                mask = (rn < nrows - j)[:, None] & (rb < n)[None, :]
                value = gate / (1.0 + gl.exp(-gate)) * up
                gl.store(out + rb[None, :] * EXPERT_INTER + (row0 + j + rn)[:, None],
                         value.to(expert_h.dtype.element_ty), mask=mask)
    return c, cx


class ExpertGateUp(TaskKind):
    name = "expert_gate_up"
    # tile `part` of the layer's `parts` (graph/lowering.py); routed: the route task's event, which the ring
    # megakernel's producer waits for before it streams the chosen experts (routed_experts)
    args = ("part", "parts", "sparse_layer", "routed")
    gpu = expert_gate_up_gpu
    ring = expert_gate_up_ring
    ring_weights = expert_gate_up_weights
    ring_routed = True

    def cost(self, shape, layer, a):
        rows = tile_rows_at_most(shape, a, shape.plan.expert_inter)
        return 2 * shape.matmul_bytes(rows, shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        part, parts = a[:2]
        segments = list(flat_segments(ctx, part, parts, ctx.plan.expert_inter))
        if not segments:
            return
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xs, rstd = normed_stream(ctx)
        for slot, expert, row0, nrows in segments:
            gate = (xs @ lw.expert_gate[expert, row0:row0 + nrows].float().t()) * rstd
            up = (xs @ lw.expert_up[expert, row0:row0 + nrows].float().t()) * rstd
            ctx.buf["expert_h"][slot, :n, row0:row0 + nrows] = (gate * torch.sigmoid(gate) * up).to(ctx.dtype)
