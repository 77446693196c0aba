"""RMSNorm of the whole residual stream x into xn (all active rows): before attention, before the MLP,
and once after the last layer. A norm needs every column of x, so it waits for all tiles that wrote it."""
from distmk.tasks.base import TaskKind, rms_norm

INPUT_NORM, POST_ATTENTION_NORM, FINAL_NORM = 0, 1, 2


class RMSNorm(TaskKind):
    name = "rmsnorm"
    args = ("which",)  # INPUT_NORM / POST_ATTENTION_NORM of `layer`, or FINAL_NORM

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
        ctx.buf["xn"][:n] = rms_norm(ctx.buf["x"][:n], weight, ctx.spec.rms_norm_eps)
