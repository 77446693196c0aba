"""Greedy next token per row: the best of the lm_head tiles' maxima on this rank, then across ranks
(vocab-parallel). Ties go to the lowest token id, as torch.argmax over the full logits would."""
import torch
import triton
import triton.language as tl

from distmk.tasks.base import TaskKind


@triton.jit
def argmax_gpu(n, tile_max, tile_arg, next_token, B_PAD: tl.constexpr, LM_TILES: tl.constexpr,
               LM_TILES_PAD: tl.constexpr):
    # one rank: the cross-rank exchange of (max, id) pairs arrives with the NVSHMEM communication layer
    rb = tl.arange(0, B_PAD)
    rt = tl.arange(0, LM_TILES_PAD)
    mask = (rb < n)[:, None] & (rt < LM_TILES)[None, :]
    maxes = tl.load(tile_max + rb[:, None] * LM_TILES + rt[None, :], mask=mask, other=float("-inf"))
    best_tile = tl.argmax(maxes, axis=1, tie_break_left=True)
    token = tl.load(tile_arg + rb * LM_TILES + best_tile, mask=rb < n, other=0)
    tl.store(next_token + rb, token, mask=rb < n)


class Argmax(TaskKind):
    name = "argmax"
    args = ()
    communicates = True
    gpu = argmax_gpu

    def cost(self, shape, layer, a):
        return shape.batch * 12 * (shape.plan.vocab // 64 + shape.plan.tp)

    def run(self, ctx, layer, a):
        n = ctx.num_rows
        # tiles are in vocabulary order, so max() picking the first maximum gives the lowest id
        local_max, tile = ctx.buf["tile_max"][:n].max(dim=-1)
        local_arg = ctx.buf["tile_arg"][:n].gather(1, tile[:, None])[:, 0]
        maxes = torch.stack(ctx.comm.gather(local_max))            # [tp, n], rank order = vocab order
        args = torch.stack(ctx.comm.gather(local_arg))
        best_rank = maxes.max(dim=0).indices
        ctx.buf["next_token"][:n] = args.gather(0, best_rank[None])[0]
