"""RMSNorm of the whole residual stream x into xn (all active rows): before attention, before the MLP,
and once after the last layer. A norm needs every column of x, so it waits for all tiles that wrote it.
Activations are rounded to their dtype only where a task stores them; the residual stream stays in float32.
(Rounding after every op, as Hugging Face's bf16 models do, cost ~2% of logit accuracy over 16 layers.)"""
import triton
import triton.language as tl

from distmk.tasks.base import TaskKind, rms_norm

INPUT_NORM, POST_ATTENTION_NORM, FINAL_NORM = 0, 1, 2
_POST = tl.constexpr(POST_ATTENTION_NORM)


@triton.jit
def rmsnorm_gpu(layer, a0, n, x, xn, norms, H: tl.constexpr, EPS: tl.constexpr, BLOCK_H: tl.constexpr):
    # norms is [2 * layers + 1, H]: input and post-attention norm of each layer, then the final norm
    weight = norms + (2 * layer + (a0 == _POST)) * H
    act = xn.dtype.element_ty
    for b in range(0, n):
        sum_sq = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(x + b * H + offs, mask=offs < H, other=0.0).to(tl.float32)
            sum_sq += v * v
        rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=0) / H + EPS)
        for h0 in range(0, H, BLOCK_H):
            offs = h0 + tl.arange(0, BLOCK_H)
            v = tl.load(x + b * H + offs, mask=offs < H, other=0.0).to(tl.float32)
            w = tl.load(weight + offs, mask=offs < H, other=0.0).to(tl.float32)
            tl.store(xn + b * H + offs, (v * rstd * w).to(act), mask=offs < H)


class RMSNorm(TaskKind):
    name = "rmsnorm"
    args = ("which",)  # INPUT_NORM / POST_ATTENTION_NORM of `layer`, or FINAL_NORM
    gpu = rmsnorm_gpu

    def cost(self, shape, layer, a):
        return 3 * shape.batch * shape.spec.hidden_size * shape.act_bytes

    def run(self, ctx, layer, a):
        (which,) = a
        if which == FINAL_NORM:
            weight = ctx.weights.final_norm
        else:
            lw = ctx.weights.layers[layer]
            weight = lw.input_norm if which == INPUT_NORM else lw.post_norm
        n = ctx.num_rows
        ctx.buf["xn"][:n] = rms_norm(ctx.buf["x"][:n], weight, ctx.spec.rms_norm_eps).to(ctx.dtype)
