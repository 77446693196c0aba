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

from distmk.device.primitives import matmul_pair, norm_rstd
from distmk.tasks.base import TaskKind, normed_stream
from distmk.tasks.route import flat_range, flat_segment, flat_segments, tile_rows_at_most


# noinline: its shared memory is not added to the other tasks' (see tasks/router.py)
@triton.jit(noinline=True)
def expert_gate_up_gpu(part, parts, sparse_layer, n, x, xs, expert_gate, expert_up,
                       route_expert, route_unique, route_count, expert_h, H: tl.constexpr, EXPERTS: tl.constexpr,
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
            offset = (sparse_layer.to(tl.int64) * EXPERTS + expert) * EXPERT_INTER * H
            out = expert_h + slot * BATCH * EXPERT_INTER
            for j in range(0, nrows, MLP_BLOCK_N):
                gate, up = matmul_pair(xs, expert_gate + offset, expert_up + offset, n, row0 + j, nrows - j, H,
                                       B_PAD, MLP_BLOCK_N, MLP_BLOCK_K, DOT_PRECISION)
                gate, up = gate * rstd, up * rstd
                mask = (rb < n)[:, None] & (rn < nrows - j)[None, :]
                tl.store(out + rb[:, None] * EXPERT_INTER + (row0 + j + rn)[None, :],
                         (gate * tl.sigmoid(gate) * up).to(act), mask=mask)


class ExpertGateUp(TaskKind):
    name = "expert_gate_up"
    args = ("part", "parts", "sparse_layer")    # tile `part` of the layer's `parts` (graph/lowering.py)
    gpu = expert_gate_up_gpu

    def cost(self, shape, layer, a):
        rows = tile_rows_at_most(shape, a, shape.plan.expert_inter)
        return 2 * shape.matmul_bytes(rows, shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        part, parts, _ = a
        segments = list(flat_segments(ctx, part, parts, ctx.plan.expert_inter))
        if not segments:
            return
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xs, rstd = normed_stream(ctx)
        for slot, expert, row0, nrows in segments:
            gate = (xs @ lw.expert_gate[expert, row0:row0 + nrows].float().t()) * rstd
            up = (xs @ lw.expert_up[expert, row0:row0 + nrows].float().t()) * rstd
            ctx.buf["expert_h"][slot, :n, row0:row0 + nrows] = (gate * torch.sigmoid(gate) * up).to(ctx.dtype)
