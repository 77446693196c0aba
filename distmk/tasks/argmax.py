"""Second half of the greedy choice: the next token of each row is the best of the ranks' published
(logit, id) pairs; ties go to the lower rank, i.e. the lowest token id, as torch.argmax over the full
logits would."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.tasks.base import TaskKind


@triton.jit
def argmax_gpu(n, best, best_id, next_token, B_PAD: tl.constexpr, WORLD: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    top = tl.load(best + rb, mask=rb < n, other=float("-inf"))
    token = tl.load(best_id + rb, mask=rb < n, other=0)
    for src in tl.static_range(1, WORLD):
        value = tl.load(best + src * B_PAD + rb, mask=rb < n, other=float("-inf"))
        better = value > top                             # strict: the lower rank keeps a tie
        token = tl.where(better, tl.load(best_id + src * B_PAD + rb, mask=rb < n, other=0), token)
        top = tl.where(better, value, top)
    tl.store(next_token + rb, token, mask=rb < n)


@gluon.jit
def argmax_ring(n, best, best_id, next_token, B_PAD: gl.constexpr, WORLD: gl.constexpr, num_warps: gl.constexpr):
    rb = gl.arange(0, B_PAD, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
    top = gl.load(best + rb, mask=rb < n, other=float("-inf"))
    token = gl.load(best_id + rb, mask=rb < n, other=0)
    for src in gl.static_range(1, WORLD):
        value = gl.load(best + src * B_PAD + rb, mask=rb < n, other=float("-inf"))
        better = value > top                             # strict: the lower rank keeps a tie
        token = gl.where(better, gl.load(best_id + src * B_PAD + rb, mask=rb < n, other=0), token)
        top = gl.where(better, value, top)
    gl.store(next_token + rb, token, mask=rb < n)


class Argmax(TaskKind):
    name = "argmax"
    args = ()
    communicates = True
    gpu = argmax_gpu
    ring = argmax_ring

    def cost(self, shape, layer, a):
        return shape.batch * 12 * shape.plan.tp

    def run(self, ctx, layer, a):
        n = ctx.num_rows
        local_best, local_id = ctx.published.pop(ctx.wait)
        maxes = torch.stack(ctx.comm.gather(local_best))           # [tp, n], rank order = vocab order
        ids = torch.stack(ctx.comm.gather(local_id))
        ctx.buf["next_token"][:n] = ids.gather(0, maxes.max(dim=0).indices[None])[0]
