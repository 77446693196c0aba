"""Greedy next token per row: the best of the lm_head tiles' maxima on this rank, then across ranks
(vocab-parallel). Ties go to the lowest token id, as torch.argmax over the full logits would."""
import torch

from distmk.tasks.base import TaskKind


class Argmax(TaskKind):
    name = "argmax"
    args = ()
    communicates = True

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
