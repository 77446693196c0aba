"""A tile of a sparse (mixture-of-experts) layer's router: the gate's logits of experts [expert0, expert0 +
nexperts) for every row, in float32, over the post-attention RMSNorm of the residual stream (computed by each
tile). The tiles of a layer cut its gate GEMV over the workers; the route task (tasks/route.py) then chooses
each row's experts from all the logits. Replicated under tensor parallelism: every rank computes every logit."""
import triton
import triton.language as tl

from distmk.device.primitives import matmul_block, rms_norm_rows
from distmk.tasks.base import TaskKind, normed_stream


# noinline, as the expert tiles: a function of its own, whose pipelined loads' shared memory is not added to the
# rest of the kernel's (inlined, these tasks took tiny-mistral's sm_90 megakernel past the 227 KB an SM has)
@triton.jit(noinline=True)
def router_gpu(layer, sparse_layer, expert0, nexperts, n, worker, x, xn, norms, router, router_logits,
               H: tl.constexpr, EXPERTS: tl.constexpr, B_PAD: tl.constexpr, EPS: tl.constexpr,
               NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    inp = xn + worker * B_PAD * H                                 # post-attention RMSNorm, by this tile
    rms_norm_rows(x, n, norms + (2 * layer + 1) * H, inp, H, EPS, NORM_BLOCK)
    w = router + sparse_layer.to(tl.int64) * EXPERTS * H
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    for j in range(0, nexperts, BLOCK_N):
        logits = matmul_block(inp, w, n, expert0 + j, nexperts - j, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)
        tl.store(router_logits + rb[:, None] * EXPERTS + (expert0 + j + rn)[None, :], logits,
                 mask=(rb < n)[:, None] & (rn < nexperts - j)[None, :])


class Router(TaskKind):
    name = "router"
    args = ("sparse_layer", "expert0", "nexperts")   # sparse_layer: the layer's index among the sparse ones
    gpu = router_gpu

    def cost(self, shape, layer, a):
        return shape.matmul_bytes(a[2], shape.spec.hidden_size)

    def run(self, ctx, layer, a):
        _, expert0, nexperts = a
        lw, n = ctx.weights.layers[layer], ctx.num_rows
        xn = normed_stream(ctx, lw.post_norm).float()
        experts = slice(expert0, expert0 + nexperts)
        ctx.buf["router_logits"][:n, experts] = xn @ lw.router[experts].float().t()
