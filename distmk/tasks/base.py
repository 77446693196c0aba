"""What a task type is: its argument fields, its cost in bytes, and its reference semantics.

Every task in a table is one int row: (type, layer, a0..a3, wait event, signal event). A TaskKind names
what a0..a3 mean for its type, estimates the bytes it moves (the scheduler's cost model), and `run`
defines exactly what it computes: the CPU reference executor calls it, and the GPU kernel must match it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from distmk.device.exchange import exchange_region, push_block, push_signal
from distmk.device.primitives import matmul_block

# A row-parallel output's tile (o_proj, down, moe_combine) adds its rows to the residual stream itself (tp=1), or
# pushes them to every rank as this rank's partial sum and signals the all-reduce's event on every rank (tp > 1:
# its allreduce task sums the ranks' partials, device/exchange.py), or only keeps them (WRITE_PARTIAL: the product
# without its all-reduce, benchmarks/overlap.py).
WRITE_PARTIAL, ADD_RESIDUAL, PUSH_PARTIAL = 0, 1, 2
_ADD_RESIDUAL, _PUSH_PARTIAL = tl.constexpr(ADD_RESIDUAL), tl.constexpr(PUSH_PARTIAL)


class TaskKind:
    name: str = ""
    args: tuple[str, ...] = ()   # meaning of a0..a3 (at most four)
    communicates = False         # needs the other ranks (all-reduce, distributed argmax)
    signals_all_ranks = False    # signals its event on every rank itself (need = tp), through the transport: True,
                                 # or (arg, value): the tasks whose arg has that value (row-parallel tiles that push)
    gpu = None                   # the @triton.jit device function the megakernel dispatches to; noinline
                                 # where it holds tiles (matmuls, attention and its reduction, the combine):
                                 # inlined, their values spilled the kernel's registers (qwen3-30b-a3b b1 on
                                 # Triton 3.6: 108 bytes), each a function of its own none spills
    gpu_prefetch = None          # optional: starts pulling the task's weights into L2 before it waits
    ring = None                  # the @gluon.jit device function of the weight-ring megakernel (ring_megakernel.py)
    ring_weights = None          # its producer half, for a task that reads weights: the ring slots it fills
    ring_prepare = None          # optional: what `ring` reads before its event (loads that do not depend on
                                 # it), run before the wait; `ring` receives its results as `prepared`
    ring_routed = False          # its weights are the experts the route task chose: the ring's producer waits for
                                 # the route (a0..a3 `routed`) and hands both partitions `routed_count`

    def cost(self, shape: "StepShape", layer: int, a: tuple[int, ...]) -> int:
        """Bytes this task reads and writes, weights included."""
        raise NotImplementedError

    def signals_every_rank(self, a: tuple[int, ...]) -> bool:
        """Whether the task of args `a` signals its event on every rank itself (signals_all_ranks)."""
        if isinstance(self.signals_all_ranks, tuple):
            arg, value = self.signals_all_ranks
            return a[self.args.index(arg)] == value
        return self.signals_all_ranks

    def run(self, ctx, layer: int, a: tuple[int, ...]) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class StepShape:
    """What the cost model needs to know about a compiled step: shapes and element sizes."""
    spec: object            # ModelSpec
    plan: object            # ShardPlan
    batch: int
    kv_splits: int
    context: int            # expected context length (cost model only; the table works for any length)
    weight_bytes: int = 2
    act_bytes: int = 2
    router_shares: int = 1  # shares of the gate's logits a row has (graph/lowering.router_shares)

    def matmul_bytes(self, rows: int, cols: int) -> int:
        """A [batch, cols] x [rows, cols]^T tile: weights once, input and output activations."""
        return rows * cols * self.weight_bytes + self.batch * (rows + cols) * self.act_bytes


def row_parallel_tile(ctx, inp: torch.Tensor, weight: torch.Tensor, row0: int, nrows: int, mode: int,
                      next_norm: int) -> None:
    """out[:, rows] = inp @ weight[rows]^T, added to the residual stream or kept as this rank's partial sum."""
    store_row_parallel(ctx, inp[:ctx.num_rows].float() @ weight[row0:row0 + nrows].float().t(), row0, nrows, mode,
                       next_norm)


def store_row_parallel(ctx, out: torch.Tensor, row0: int, nrows: int, mode: int, next_norm: int) -> None:
    """A row-parallel output's columns [row0, row0 + nrows) (float32, [rows, nrows]) by `mode`: added to the
    residual stream (whose next RMSNorm is norm_weight's `next_norm`), pushed to every rank as this rank's partial
    sum (for the allreduce task that waits on this task's event), or kept as it."""
    n = ctx.num_rows
    if mode == ADD_RESIDUAL:
        cols = slice(row0, row0 + nrows)
        store_residual(ctx, slice(0, n), cols, ctx.buf["x"][:n, cols].float() + out, next_norm)
    elif mode == PUSH_PARTIAL:
        ctx.published[ctx.signal] = out.clone()
    else:
        ctx.buf["partial"][:n, row0:row0 + nrows] = out


@triton.jit
def store_residual_gpu(x, xs, offs, mask, values, next_norm_w):
    """GPU twin of store_residual: the residual stream's elements at offs become `values` (float32), the scaled
    stream's the stored values times next_norm_w (the next RMSNorm's weight at these columns, broadcast against
    `values`), rounded once."""
    tl.store(x + offs, values.to(x.dtype.element_ty), mask=mask)
    stored = values.to(x.dtype.element_ty).to(tl.float32)
    tl.store(xs + offs, (stored * next_norm_w).to(xs.dtype.element_ty), mask=mask)


@triton.jit
def store_row_parallel_gpu(values, rb, rn, j, row0, nrows, mode, n, x, xs, next_norm_w, partial, region, exchange,
                           exchange_peers, H: tl.constexpr, WORLD: tl.constexpr, TRANSPORT: tl.constexpr):
    """GPU twin of store_row_parallel for the block of a tile's columns j + rn ([B_PAD, BLOCK_N] float32 values of
    rows rb; region: this rank's rows of the exchange, device/exchange.py). A tile that pushes calls push_signal
    after its last block."""
    cols = row0 + j + rn
    offs = rb[:, None] * H + cols[None, :]
    mask = (rb < n)[:, None] & (rn < nrows - j)[None, :]
    if mode == _ADD_RESIDUAL:
        residual = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(next_norm_w + cols, mask=rn < nrows - j, other=0.0).to(tl.float32)
        store_residual_gpu(x, xs, offs, mask, residual + values, g[None, :])
    elif mode == _PUSH_PARTIAL:
        push_block(values, rb, j + rn, mask, region, nrows, exchange, exchange_peers, WORLD, TRANSPORT)
    else:
        tl.store(partial + offs, values, mask=mask)


@triton.jit
def row_parallel_gpu(inp, w, row0, nrows, mode, n, x, xs, next_norm_w, partial, output, rank, signal, exchange,
                     exchange_peers, counters, counter_peers, K: tl.constexpr, H: tl.constexpr, B_PAD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     WORLD: tl.constexpr, EXCHANGE_SLOTS: tl.constexpr, TRANSPORT: tl.constexpr,
                     SIGNAL_ADD: tl.constexpr, scale=None):
    """GPU twin of row_parallel_tile: rows [row0, row0 + nrows) of inp @ w^T, by `mode` (next_norm_w: the weight
    of the residual stream's next RMSNorm; output: which row-parallel output of the step it is, for the exchange;
    `scale`: e4m3 weights' block scales)."""
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    region = exchange_region(row0, output, rank, H, B_PAD, WORLD, EXCHANGE_SLOTS)
    for j in range(0, nrows, BLOCK_N):
        acc = matmul_block(inp, w, n, row0 + j, nrows - j, K, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION, scale)
        store_row_parallel_gpu(acc, rb, rn, j, row0, nrows, mode, n, x, xs, next_norm_w, partial, region, exchange,
                               exchange_peers, H, WORLD, TRANSPORT)
    if mode == _PUSH_PARTIAL:
        push_signal(region, n, nrows, rank, signal, exchange, counters, counter_peers, WORLD, TRANSPORT, SIGNAL_ADD)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 (the caller rounds once, where it stores)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def norm_weight(ctx, index: int) -> torch.Tensor:
    """RMSNorm weight `index`, in the order the megakernels stack them (kernels/layout.py's `norms`): 2l is layer
    l's input norm, 2l + 1 its post-attention norm, 2L (L layers) the final norm."""
    layer, post = divmod(index, 2)
    if layer == ctx.spec.num_layers:
        return ctx.weights.final_norm
    lw = ctx.weights.layers[layer]
    return lw.post_norm if post else lw.input_norm


def store_residual(ctx, rows, cols, values: torch.Tensor, next_norm: int) -> None:
    """x[rows, cols], the residual stream, becomes `values`, and the same elements of the scaled stream xs = x * w,
    rounded once to the activation dtype, where w is the weight of the RMSNorm that reads the stream next
    (norm_weight's `next_norm`). Whoever finishes elements of x stores them scaled, once: the tiles that read the
    normed stream take xs as it is (normed_stream)."""
    x = ctx.buf["x"]
    x[rows, cols] = values.to(x.dtype)
    ctx.buf["xs"][rows, cols] = (x[rows, cols].float() * norm_weight(ctx, next_norm)[cols].float()).to(ctx.dtype)


def normed_stream(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The RMSNorm of the residual stream's active rows as the QKV, gate/up, router and lm_head tiles read it:
    RMSNorm(x) @ W^T = (xs @ W^T) * rstd, xs the scaled stream (store_residual) and rstd = 1 / rms(x) of each
    row, in float32. The scale comes after the product, so a tile's first weights meet its input as soon as its
    event allows, with no normalisation of its own in between. Returns xs and rstd [rows, 1] in float32."""
    n = ctx.num_rows
    x = ctx.buf["x"][:n].float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.spec.rms_norm_eps)
    return ctx.buf["xs"][:n].float(), rstd


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of x [rows, heads, D] at positions [rows], in float32."""
    return rotate(x, *rope_angles(positions, inv_freq))


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, 1, D] of the rotary angles at positions [rows] (the prefill computes them once a chunk)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def rope_table(inv_freq: torch.Tensor, positions: int) -> torch.Tensor:
    """[positions, D] float32: the cosines of rope_angles at positions 0..positions-1 in the first D/2 columns,
    their sines in the rest (the angles of columns d and d + D/2 are one), for the kernels to load."""
    cos, sin = rope_angles(torch.arange(positions), inv_freq)
    half = inv_freq.shape[0]
    return torch.cat([cos[:, 0, :half], sin[:, 0, :half]], dim=-1).contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, D] rotated by the angles of rope_angles, in float32."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    return x32 * cos + torch.cat((-x32[..., half:], x32[..., :half]), dim=-1) * sin
