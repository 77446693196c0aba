"""First half of the greedy choice: this rank's best (logit, token id) per row over its lm_head tiles,
published to every rank (vocab-parallel lm_head), signalling the exchange's event on every rank."""
import triton
import triton.language as tl

from distmk.tasks.base import TaskKind


@triton.jit
def argmax_push_gpu(n, rank, tile_max, tile_arg, best_peers, best_id_peers, B_PAD: tl.constexpr,
                    LM_TILES: tl.constexpr, LM_TILES_PAD: tl.constexpr, WORLD: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rt = tl.arange(0, LM_TILES_PAD)
    mask = (rb < n)[:, None] & (rt < LM_TILES)[None, :]
    maxes = tl.load(tile_max + rb[:, None] * LM_TILES + rt[None, :], mask=mask, other=float("-inf"))
    best_tile = tl.argmax(maxes, axis=1, tie_break_left=True)   # tiles in vocabulary order: lowest id wins
    best = tl.max(maxes, axis=1)
    token = tl.load(tile_arg + rb * LM_TILES + best_tile, mask=rb < n, other=0)
    for p in tl.static_range(WORLD):               # best and best_id are [WORLD, B_PAD] on every rank
        peer_best = tl.load(best_peers + p).to(tl.pointer_type(tl.float32))
        peer_id = tl.load(best_id_peers + p).to(tl.pointer_type(tl.int64))
        tl.store(peer_best + rank * B_PAD + rb, best, mask=rb < n)
        tl.store(peer_id + rank * B_PAD + rb, token, mask=rb < n)


class ArgmaxPush(TaskKind):
    name = "argmax_push"
    args = ()
    communicates = True
    signals_all_ranks = True
    gpu = argmax_push_gpu

    def cost(self, shape, layer, a):
        return shape.batch * 12 * (shape.plan.vocab // 64 + shape.plan.tp)

    def run(self, ctx, layer, a):
        n = ctx.num_rows
        best, tile = ctx.buf["tile_max"][:n].max(dim=-1)          # first maximum: the lowest token id
        ctx.published[ctx.signal] = (best, ctx.buf["tile_arg"][:n].gather(1, tile[:, None])[:, 0])
