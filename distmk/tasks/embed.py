"""Embedding lookup for one batch row: x[b] = E[token[b]], and the scaled stream of the row for the first
layer's input norm (tasks/base.py store_residual)."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.tasks.base import TaskKind, store_residual, store_residual_gpu


@triton.jit
def embed_gpu(row, n, tokens, embed, x, xs, norms, H: tl.constexpr, BLOCK_H: tl.constexpr):
    if row < n:
        token = tl.load(tokens + row).to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            values = tl.load(embed + token * H + offs, mask=offs < H).to(tl.float32)
            g = tl.load(norms + offs, mask=offs < H).to(tl.float32)         # norm 0: the first input norm
            store_residual_gpu(x, xs, row * H + offs, offs < H, values, g)


@gluon.jit
def embed_ring(row, n, tokens, embed, x, xs, norms, H: gl.constexpr, BLOCK_H: gl.constexpr, num_warps: gl.constexpr):
    if row < n:
        token = gl.load(tokens + row).to(gl.int64)
        offs0 = gl.arange(0, BLOCK_H, layout=gl.BlockedLayout([4], [32], [num_warps], [0]))
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + offs0
            values = gl.load(embed + token * H + offs, mask=offs < H).to(gl.float32)
            g = gl.load(norms + offs, mask=offs < H).to(gl.float32)
            rg.store_residual_ring(x, xs, row * H + offs, offs < H, values, g)


class Embed(TaskKind):
    name = "embed"
    args = ("row",)
    gpu = embed_gpu
    ring = embed_ring

    def cost(self, shape, layer, a):
        return 3 * shape.spec.hidden_size * shape.act_bytes

    def run(self, ctx, layer, a):
        (b,) = a
        if b < ctx.num_rows:
            store_residual(ctx, b, slice(None), ctx.weights.embed[ctx.tokens[b]].float(), 0)
