"""First half of the greedy choice: this rank's best (logit, token id) per row over its lm_head tiles,
published to every rank (vocab-parallel lm_head), signalling the exchange's event on every rank.
best and best_id are symmetric [WORLD, B_PAD] on every rank; transports as in device/exchange.py."""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device.nvshmem import fence, putmem_block, putmem_signal_block
from distmk.device.primitives import signal_all_ranks
from distmk.device import ring as rg
from distmk.tasks.base import TaskKind


@triton.jit
def argmax_push_gpu(n, rank, signal, tile_max, tile_arg, best, best_id, best_peers, best_id_peers, counters,
                    counter_peers, B_PAD: tl.constexpr, LM_TILES: tl.constexpr, LM_TILES_PAD: tl.constexpr,
                    WORLD: tl.constexpr, TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr):
    rb = tl.arange(0, B_PAD)
    rt = tl.arange(0, LM_TILES_PAD)
    mask = (rb < n)[:, None] & (rt < LM_TILES)[None, :]
    maxes = tl.load(tile_max + rb[:, None] * LM_TILES + rt[None, :], mask=mask, other=float("-inf"))
    best_tile = tl.argmax(maxes, axis=1, tie_break_left=True)   # tiles in vocabulary order: lowest id wins
    top = tl.max(maxes, axis=1)
    token = tl.load(tile_arg + rb * LM_TILES + best_tile, mask=rb < n, other=0)
    mine = rank * B_PAD + rb
    if TRANSPORT == 0:
        for p in tl.static_range(WORLD):
            peer_best = tl.load(best_peers + p).to(tl.pointer_type(tl.float32))
            peer_id = tl.load(best_id_peers + p).to(tl.pointer_type(tl.int64))
            tl.store(peer_best + mine, top, mask=rb < n)
            tl.store(peer_id + mine, token, mask=rb < n)
        signal_all_ranks(counter_peers, signal, WORLD)
    else:
        tl.store(best + mine, top, mask=rb < n)
        tl.store(best_id + mine, token, mask=rb < n)
        tl.debug_barrier()
        values = (best + rank * B_PAD).to(tl.int64)
        ids = (best_id + rank * B_PAD).to(tl.int64)
        for p in tl.static_range(WORLD):
            if p != rank:
                putmem_block(values, values, (n * 4).to(tl.int64), p)
                fence()                 # the values land before the ids' signal
                putmem_signal_block(ids, ids, (n * 8).to(tl.int64), (counters + signal).to(tl.int64),
                                    tl.full((), 1, tl.uint64), SIGNAL_ADD, p)
        tl.atomic_add(counters + signal, 1, sem="release", scope="sys")


@gluon.jit
def argmax_push_ring(n, rank, signal, tile_max, tile_arg, best_peers, best_id_peers, counter_peers,
                     B_PAD: gl.constexpr, LM_TILES: gl.constexpr, LM_TILES_PAD: gl.constexpr, WORLD: gl.constexpr,
                     SYSTEM_SCOPE: gl.constexpr, num_warps: gl.constexpr):
    """The pointer transport (TRANSPORT 0) on the ring: this rank's best stored into every rank's best/best_id
    (at tp=1 its own), then the event bumped on every rank."""
    layout: gl.constexpr = rg.rows_layout(num_warps)
    rb = gl.arange(0, B_PAD, layout=gl.SliceLayout(1, layout))
    rt = gl.arange(0, LM_TILES_PAD, layout=gl.SliceLayout(0, layout))
    mask = (rb < n)[:, None] & (rt < LM_TILES)[None, :]
    maxes = gl.load(tile_max + rb[:, None] * LM_TILES + rt[None, :], mask=mask, other=float("-inf"))
    top = gl.max(maxes, axis=1)
    # tiles in vocabulary order: the lowest tile that reaches the maximum holds the lowest id
    best_tile = gl.min(gl.where(maxes == top[:, None], rt[None, :], LM_TILES_PAD), axis=1)
    token = gl.load(tile_arg + rb * LM_TILES + best_tile, mask=(rb < n) & (best_tile < LM_TILES), other=0)
    for p in gl.static_range(WORLD):
        gl.store(rg.peer_pointer(best_peers, p, gl.float32) + rank * B_PAD + rb, top, mask=rb < n)
        gl.store(rg.peer_pointer(best_id_peers, p, gl.int64) + rank * B_PAD + rb, token, mask=rb < n)
    rg.signal_all_ranks(counter_peers, signal, WORLD, SYSTEM_SCOPE, num_warps)


class ArgmaxPush(TaskKind):
    name = "argmax_push"
    args = ()
    communicates = True
    signals_all_ranks = True
    gpu = argmax_push_gpu
    ring = argmax_push_ring

    def cost(self, shape, layer, a):
        return shape.batch * 12 * (shape.plan.vocab // 64 + shape.plan.tp)

    def run(self, ctx, layer, a):
        n = ctx.num_rows
        best, tile = ctx.buf["tile_max"][:n].max(dim=-1)          # first maximum: the lowest token id
        ctx.published[ctx.signal] = (best, ctx.buf["tile_arg"][:n].gather(1, tile[:, None])[:, 0])
