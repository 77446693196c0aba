"""A toy task type, the whole of what adding one takes (this file and one `register` line): it doubles one
row of the residual stream. tests/test_megakernel_interpreted.py runs it through the reference executor and
the interpreted megakernel."""
import triton
import triton.language as tl

from distmk.tasks.base import TaskKind


@triton.jit
def double_gpu(row, n, x, H: tl.constexpr, BLOCK_H: tl.constexpr):
    if row < n:
        for c in range(0, H, BLOCK_H):
            offs = c + tl.arange(0, BLOCK_H)
            values = tl.load(x + row * H + offs, mask=offs < H)
            tl.store(x + row * H + offs, values * 2, mask=offs < H)


class Double(TaskKind):
    name = "double"
    args = ("row",)
    gpu = double_gpu

    def cost(self, shape, layer, a):
        return 2 * shape.spec.hidden_size * 4

    def run(self, ctx, layer, a):
        row, = a
        if row < ctx.num_rows:
            ctx.buf["x"][row] *= 2
