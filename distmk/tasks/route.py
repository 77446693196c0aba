"""The choice of a sparse (mixture-of-experts) layer's experts, for every row, from the gate's logits (the router
tiles', or the sum of the o_proj tiles' shares: tasks/router.py): softmax in float32 and the top-k experts of
each row, their probabilities renormalised to sum to 1 where the model says so (norm_topk_prob).

A row's k-th choice is slot b * top_k + k. The task writes each slot's expert and weight, the first slot of
the step that chose the same expert (route_slot: the slot that *leads* for it), and the leading slots in
increasing order with their count (route_unique, route_count): the step's distinct experts. The expert tiles
(expert_gate_up.py, expert_down.py) cut the distinct experts' rows, laid end to end, evenly over themselves at
run time (flat_segments), so rows that pick the same expert share one stream of its weights and the tiles
stay balanced however many rows share experts, while the table stays static: at batch 8 of mixtral-8x7b about
7 of 16 slots lead, and tiles fixed to a slot left most of the workers idle behind the leaders' tiles. It also
keeps each sparse layer's choices of the step in route_history (the next layer's route task overwrites
route_expert), which nothing in the step reads: what a benchmark or a test asks of the step afterwards.
Replicated under tensor parallelism: every rank routes every row to the same experts."""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from distmk.device import ring as rg
from distmk.tasks.base import TaskKind
from distmk.tasks.router import router_logits


def choose(logits: torch.Tensor, top_k: int, renormalise: bool):
    """(weights [rows, top_k] float32, experts [rows, top_k] int64) of the gate's logits [rows, experts]: softmax
    in float32, the top_k largest in descending order, renormalised on request (the route task's semantics,
    and the prefill path's)."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def flat_segments(ctx, part: int, parts: int, rows: int):
    """The pieces of tile `part` of `parts` over the step's distinct experts' `rows` rows each, laid end to end
    in route_unique's order (the u-th distinct expert's rows are [u * rows, (u + 1) * rows)): (slot, expert,
    row0, nrows) for each expert the tile's range [part * F // parts, (part + 1) * F // parts) of the F =
    route_count * rows rows touches, row0 and nrows within that expert; its leading slot runs it for every row
    that chose it."""
    total = int(ctx.buf["route_count"][0]) * rows
    lo, hi = part * total // parts, (part + 1) * total // parts
    for u in range(lo // rows, -(-hi // rows) if lo < hi else 0):
        slot = int(ctx.buf["route_unique"][u])
        row0 = max(lo - u * rows, 0)
        yield slot, int(ctx.buf["route_expert"].view(-1)[slot]), row0, min(hi - u * rows, rows) - row0


def tile_rows_at_most(shape, a, rows: int) -> int:
    """The rows of expert tile a = (part, parts, ...) when every slot leads (the most a step can give it): the
    tile's cost, for the scheduler."""
    part, parts, total = a[0], a[1], shape.batch * shape.spec.experts_per_token * rows
    return (part + 1) * total // parts - part * total // parts


@triton.jit
def flat_range(part, parts, route_count, ROWS: tl.constexpr, TOP_K: tl.constexpr, BATCH: tl.constexpr):
    """flat_segments on the device: the tile's rows [lo, hi) of the flattened distinct experts' ROWS rows each,
    and the distinct experts [u0, u1) they touch, none when the range is empty (int64: parts x experts x rows
    may pass 2^31). A table of one row (BATCH 1) knows the count without loading it: every slot leads, and the
    tile's weight address then waits for one load (its expert) instead of three in a row."""
    if BATCH == 1:
        total = tl.full((), TOP_K * ROWS, tl.int64)
    else:
        total = tl.load(route_count) * ROWS
    lo = part * total // parts
    hi = (part + 1) * total // parts
    return lo, hi, lo // ROWS, tl.where(lo < hi, (hi + ROWS - 1) // ROWS, 0)


@triton.jit
def flat_segment(u, lo, hi, route_unique, route_expert, ROWS: tl.constexpr, BATCH: tl.constexpr):
    """The tile's piece of distinct expert u (u0 <= u < u1 of flat_range): its leading slot, the expert, and
    the rows [row0, row0 + nrows) of that expert (at BATCH 1 the u-th slot leads for the u-th expert)."""
    if BATCH == 1:
        slot = u
    else:
        slot = tl.load(route_unique + u)
    row0 = tl.maximum(lo - u * ROWS, 0)
    return slot, tl.load(route_expert + slot), row0, tl.minimum(hi - u * ROWS, ROWS) - row0


# noinline: inlined, it took the tl megakernel's entry from 136 / 184 to 236 / 280 bytes of spill stores / loads
# (ptxas, sm_90a, qwen3-30b-a3b at batch 1), 188 / 240 as a function of its own
@triton.jit(noinline=True)
def route_gpu(sparse_layer, partials, n, router_logits, router_partial, router_sumsq, route_expert, route_weight,
              route_slot, route_unique, route_count, route_history, H: tl.constexpr, EPS: tl.constexpr,
              EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
              SLOTS_PAD: tl.constexpr, NORM_TOPK: tl.constexpr, BATCH: tl.constexpr, ROUTER_PARTS: tl.constexpr):
    """A row at a time: its probabilities, then its TOP_K largest by one bitonic top-k (tl.topk) of keys that
    pack a probability's bits (non-negative floats order as their bits) above the expert's index reversed, so
    the keys are distinct and ties go to the lower index, as a left-first argmax; the chosen slots are stored
    in order (cheaper than each expert's rank from an [experts, experts] comparison, which it replaced). Then each
    slot's leading slot, and the leading slots in order, each stored at the number of leading slots before it
    (a prefix sum, no atomics). With `partials` a row's logits are the sum of the o_proj tiles' shares (in a
    fixed order: the same bits every run), scaled by the RMSNorm's rstd (router_logits)."""
    re = tl.arange(0, EXPERTS_PAD)
    rk = tl.arange(0, TOP_K_PAD)
    rt = tl.arange(0, 32)
    for b in range(n):
        if partials:
            # the shares of 32 tiles at a time added elementwise, reduced across tiles once at the end: unrolled
            # and with no reduction (a CTA barrier) between them, every chunk's loads can be in flight together
            # rather than one L2 round trip after another
            total = tl.zeros((32, EXPERTS_PAD), dtype=tl.float32)
            sumsq = tl.zeros((32,), dtype=tl.float32)
            for t0 in tl.static_range(0, ROUTER_PARTS, 32):
                shares = (t0 + rt) < ROUTER_PARTS
                total += tl.load(router_partial + ((t0 + rt[:, None]) * BATCH + b) * EXPERTS + re[None, :],
                                 mask=shares[:, None] & (re < EXPERTS)[None, :], other=0.0)
                sumsq += tl.load(router_sumsq + (t0 + rt) * BATCH + b, mask=shares, other=0.0)
            logits = tl.sum(total, axis=0) * tl.math.rsqrt(tl.sum(sumsq, axis=0) / H + EPS)
            logits = tl.where(re < EXPERTS, logits, float("-inf"))
        else:
            logits = tl.load(router_logits + b * EXPERTS + re, mask=re < EXPERTS, other=float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = tl.where(re < EXPERTS, p / tl.sum(p, axis=0), -1.0)      # padding ranks below every expert
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (EXPERTS_PAD - 1 - re).to(tl.int64)
        top = tl.topk(key, TOP_K_PAD, dim=0)
        expert = EXPERTS_PAD - 1 - (top & 0xFFFFFFFF)
        weight = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        if NORM_TOPK:
            weight = weight / tl.sum(tl.where(rk < TOP_K, weight, 0.0), axis=0)
        slot = b * TOP_K + rk
        tl.store(route_expert + slot, expert, mask=rk < TOP_K)
        tl.store(route_weight + slot, weight, mask=rk < TOP_K)
        tl.store(route_history + sparse_layer.to(tl.int64) * BATCH * TOP_K + slot, expert, mask=rk < TOP_K)
    rs = tl.arange(0, SLOTS_PAD)
    slots = rs < n * TOP_K
    if n == 1:      # a row's choices are distinct experts: every slot leads (no round trip through memory)
        tl.store(route_slot + rs, rs.to(tl.int64), mask=slots)
        tl.store(route_unique + rs, rs.to(tl.int64), mask=slots)
        tl.store(route_count, TOP_K)
    else:
        tl.debug_barrier()      # the whole CTA reads the choices its threads wrote
        # each slot's first slot with the same expert, comparing all slots with 16 of them at a time
        expert = tl.load(route_expert + rs, mask=slots, other=-1)
        first = tl.full((SLOTS_PAD,), SLOTS_PAD, tl.int64)
        for c0 in range(0, n * TOP_K, 16):
            cs = c0 + tl.arange(0, 16)
            other = tl.load(route_expert + cs, mask=cs < n * TOP_K, other=-2)
            same = expert[:, None] == other[None, :]
            first = tl.minimum(first, tl.min(tl.where(same, cs[None, :].to(tl.int64), SLOTS_PAD), axis=1))
        tl.store(route_slot + rs, first, mask=slots)
        lead = (slots & (first == rs)).to(tl.int32)      # route_unique: a leader at the count of leaders before it
        tl.store(route_unique + tl.cumsum(lead, axis=0) - lead, rs.to(tl.int64), mask=lead > 0)
        tl.store(route_count, tl.sum(lead, axis=0))


@triton.jit
def route_if_last_gpu(sparse_layer, n, router_logits, router_partial, router_sumsq, route_arrivals, route_expert,
                      route_weight, route_slot, route_unique, route_count, route_history, H: tl.constexpr,
                      EPS: tl.constexpr, EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr,
                      TOP_K_PAD: tl.constexpr, SLOTS_PAD: tl.constexpr, NORM_TOPK: tl.constexpr, BATCH: tl.constexpr,
                      ROUTER_PARTS: tl.constexpr):
    """fused_route, after an o_proj tile stored its share of the sparse layer's logits: the tile whose share makes
    the layer's count of arrivals a multiple of ROUTER_PARTS (acq_rel: every other share is visible to it) routes
    the layer before the tile signals, so the expert tiles wait on the o_proj tiles' event (no route phase)."""
    tl.debug_barrier()          # every thread's share precedes the count
    arrived = tl.atomic_add(route_arrivals + sparse_layer, 1, sem="acq_rel", scope="gpu")
    if (arrived + 1) % ROUTER_PARTS == 0:
        route_gpu(sparse_layer, 1, n, router_logits, router_partial, router_sumsq, route_expert, route_weight,
                  route_slot, route_unique, route_count, route_history, H, EPS, EXPERTS, EXPERTS_PAD, TOP_K,
                  TOP_K_PAD, SLOTS_PAD, NORM_TOPK, BATCH, ROUTER_PARTS)


@gluon.constexpr_function
def flat_rows_fit_int32(ROWS, TOP_K, BATCH):
    """Whether ring_flat_range's products fit in int32 for up to 1024 tiles: its divisions then take a few dozen
    instructions rather than int64's hundred-odd, inlined at every expert tile's call (the kernel's code is what its
    latency-bound tasks wait on)."""
    return 1024 * BATCH * TOP_K * ROWS < 2 ** 31


@gluon.jit
def ring_flat_range(part, parts, count, ROWS: gl.constexpr, TOP_K: gl.constexpr, BATCH: gl.constexpr):
    """flat_range in Gluon, of `count` distinct experts (routed_count: what the ring's producer saw the route
    choose, the same number for both partitions)."""
    if flat_rows_fit_int32(ROWS, TOP_K, BATCH):
        total = count.to(gl.int32) * ROWS
        part = part.to(gl.int32)
        parts = parts.to(gl.int32)
    else:
        total = count.to(gl.int64) * ROWS
    lo = part * total // parts
    hi = (part + 1) * total // parts
    return lo, hi, lo // ROWS, (hi + ROWS - 1) // ROWS * (lo < hi).to(lo.dtype)


@gluon.jit
def ring_flat_segment(u, lo, hi, route_unique, route_expert, ROWS: gl.constexpr, BATCH: gl.constexpr):
    """flat_segment in Gluon, its expert and rows in int32 (TMA coordinates)."""
    if BATCH == 1:
        slot = u
    else:
        slot = gl.load(route_unique + u)
    row0 = gl.maximum(lo - u * ROWS, 0)
    nrows = gl.minimum(hi - u * ROWS, ROWS) - row0
    return slot, gl.load(route_expert + slot).to(gl.int32), row0.to(gl.int32), nrows.to(gl.int32)


@gluon.jit
def load_routed_blocks(part, parts, sparse_layer, routed_count, route_unique, route_expert, desc, paired_desc,
                       PAIRED: gl.constexpr, ROWS: gl.constexpr, K: gl.constexpr, EXPERTS: gl.constexpr,
                       TOP_K: gl.constexpr, BATCH: gl.constexpr, ring, ready, empty, c, RING_INFLIGHT: gl.constexpr):
    """The ring producer's half of an expert tile: its segments' rows of each chosen expert's matrix `desc`
    ([sparse layers x experts x ROWS, K]) a block at a time, each block followed by the same rows of `paired_desc`
    where PAIRED (gate, then up); returns the slots filled so far."""
    BN: gl.constexpr = ring.type.shape[1]
    first = c
    lo, hi, u0, u1 = ring_flat_range(part, parts, routed_count, ROWS, TOP_K, BATCH)
    for u in range(u0, u1):
        _, expert, row0, nrows = ring_flat_segment(u, lo, hi, route_unique, route_expert, ROWS, BATCH)
        base = (sparse_layer * EXPERTS + expert) * ROWS + row0
        for j in range(0, nrows, BN):
            c = rg.load_block(desc, base + j, nrows - j, K, ring, ready, empty, c, first, RING_INFLIGHT)
            if PAIRED:
                c = rg.load_block(paired_desc, base + j, nrows - j, K, ring, ready, empty, c, first, RING_INFLIGHT)
    return c


@gluon.jit
def routed_experts(ok, route_count, TOP_K: gl.constexpr, BATCH: gl.constexpr):
    """The ring megakernel's producer, before an expert tile's weights, once its own wait for the route task's event
    returned `ok` (0: it gave up, and the step is failed: the wait reported it): the step's distinct experts, or 0.
    The producer hands the count to the tasks partition (device/ring.py publish_count), so both walk the same
    segments whatever the wait's verdict: slots filled and slots consumed always match, and a failed step still
    ends."""
    count = gl.to_tensor(0)
    if ok == 1:
        if BATCH == 1:
            count = gl.to_tensor(TOP_K)
        else:
            count = gl.load(route_count).to(gl.int32)
    return count


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _summed_shares(b, router_partial, router_sumsq, H: gl.constexpr, EPS: gl.constexpr, EXPERTS: gl.constexpr,
                   EXPERTS_PAD: gl.constexpr, BATCH: gl.constexpr, ROUTER_PARTS: gl.constexpr,
                   layout: gl.constexpr):
    """Row b's logits from the o_proj tiles' shares, 32 shares at a time added elementwise and reduced across them
    once, in a fixed order (route_gpu's)."""
    rt = gl.arange(0, 32, layout=gl.SliceLayout(1, layout))
    re = gl.arange(0, EXPERTS_PAD, layout=gl.SliceLayout(0, layout))
    total = gl.zeros([32, EXPERTS_PAD], gl.float32, layout)
    sumsq = gl.zeros([32], gl.float32, gl.SliceLayout(1, layout))
    for t0 in gl.static_range(0, ROUTER_PARTS, 32):
        shares = (t0 + rt) < ROUTER_PARTS
        total += gl.load(router_partial + ((t0 + rt[:, None]) * BATCH + b) * EXPERTS + re[None, :],
                         mask=shares[:, None] & (re < EXPERTS)[None, :], other=0.0)
        sumsq += gl.load(router_sumsq + (t0 + rt) * BATCH + b, mask=shares, other=0.0)
    return gl.sum(total, axis=0) * gl.rsqrt(gl.sum(sumsq, axis=0) / H + EPS)


@gluon.jit
def route_ring(sparse_layer, partials, n, router_logits, router_partial, router_sumsq, route_expert, route_weight,
               route_slot, route_unique, route_count, route_history, H: gl.constexpr, EPS: gl.constexpr,
               EXPERTS: gl.constexpr, EXPERTS_PAD: gl.constexpr, TOP_K: gl.constexpr, TOP_K_PAD: gl.constexpr,
               SLOTS_PAD: gl.constexpr, NORM_TOPK: gl.constexpr, BATCH: gl.constexpr, ROUTER_PARTS: gl.constexpr,
               num_warps: gl.constexpr):
    """route_gpu in Gluon: every row at once, a warp across a row's experts (its reductions stay in the warp), the
    TOP_K largest keys (route_gpu's: a probability's bits above the expert's index reversed) taken one at a time.
    Then the leading slots as route_gpu finds them."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    RB: gl.constexpr = rg.next_power_of_2(BATCH)
    rb = gl.arange(0, RB, layout=gl.SliceLayout(1, layout))
    re = gl.arange(0, EXPERTS_PAD, layout=gl.SliceLayout(0, layout))
    rk = gl.arange(0, TOP_K_PAD, layout=gl.SliceLayout(0, layout))
    valid = (rb < n)[:, None] & (re < EXPERTS)[None, :]
    if partials:
        logits = gl.full([RB, EXPERTS_PAD], float("-inf"), gl.float32, layout)
        for b in range(n):
            row = _summed_shares(b, router_partial, router_sumsq, H, EPS, EXPERTS, EXPERTS_PAD, BATCH, ROUTER_PARTS,
                                 layout)
            logits = gl.where((rb == b)[:, None] & valid, row[None, :], logits)
    else:
        logits = gl.load(router_logits + rb[:, None] * EXPERTS + re[None, :], mask=valid, other=float("-inf"))
    p = gl.exp(logits - gl.max(logits, axis=1)[:, None])
    p = gl.where(valid, p / gl.sum(p, axis=1)[:, None], -1.0)          # padding ranks below every expert
    key = (p.to(gl.int32, bitcast=True).to(gl.int64) << 32) | (EXPERTS_PAD - 1 - re).to(gl.int64)[None, :]
    expert = gl.zeros([RB, TOP_K_PAD], gl.int64, layout)
    weight = gl.zeros([RB, TOP_K_PAD], gl.float32, layout)
    for k in range(TOP_K):          # not unrolled: the kernel's code is what its latency-bound tasks wait on
        top = gl.max(key, axis=1)
        key = gl.where(key == top[:, None], -1, key)        # below every expert's key: taken
        expert = gl.where(rk[None, :] == k, (EXPERTS_PAD - 1 - (top & 0xFFFFFFFF))[:, None], expert)
        weight = gl.where(rk[None, :] == k, (top >> 32).to(gl.int32).to(gl.float32, bitcast=True)[:, None], weight)
    if NORM_TOPK:
        weight = weight / gl.sum(weight, axis=1)[:, None]
    slot = rb[:, None] * TOP_K + rk[None, :]
    chosen = (rb < n)[:, None] & (rk < TOP_K)[None, :]
    gl.store(route_expert + slot, expert, mask=chosen)
    gl.store(route_weight + slot, weight, mask=chosen)
    gl.store(route_history + sparse_layer.to(gl.int64) * BATCH * TOP_K + slot, expert, mask=chosen)
    flat: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [1, 0])
    rs = gl.arange(0, SLOTS_PAD, layout=gl.SliceLayout(1, flat))
    slots = rs < n * TOP_K
    if n == 1:      # a row's choices are distinct experts: every slot leads
        gl.store(route_slot + rs, rs.to(gl.int64), mask=slots)
        gl.store(route_unique + rs, rs.to(gl.int64), mask=slots)
        gl.store(route_count, TOP_K)
    else:
        rg.cta_barrier()        # the whole CTA reads the choices its threads wrote
        # each slot's first slot with the same expert, comparing all slots with 16 of them at a time
        mine = gl.load(route_expert + rs, mask=slots, other=-1)
        first = gl.full([SLOTS_PAD], SLOTS_PAD, gl.int64, gl.SliceLayout(1, flat))
        for c0 in range(0, n * TOP_K, 16):
            cs = c0 + gl.arange(0, 16, layout=gl.SliceLayout(0, flat))
            other = gl.load(route_expert + cs, mask=cs < n * TOP_K, other=-2)
            same = mine[:, None] == other[None, :]
            first = gl.minimum(first, gl.min(gl.where(same, cs[None, :].to(gl.int64), SLOTS_PAD), axis=1))
        gl.store(route_slot + rs, first, mask=slots)
        # route_unique: a leader at the count of leaders before it (a scan takes a plain blocked layout)
        line: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        lead = gl.convert_layout((slots & (first == rs)).to(gl.int32), line)
        leader = gl.arange(0, SLOTS_PAD, layout=line).to(gl.int64)
        gl.store(route_unique + gl.associative_scan(lead, 0, _add) - lead, leader, mask=lead > 0)
        gl.store(route_count, gl.sum(lead, axis=0).to(gl.int64))


@gluon.jit
def route_if_last_ring(sparse_layer, n, router_logits, router_partial, router_sumsq, route_arrivals, route_expert,
                       route_weight, route_slot, route_unique, route_count, route_history, H: gl.constexpr,
                       EPS: gl.constexpr, EXPERTS: gl.constexpr, EXPERTS_PAD: gl.constexpr, TOP_K: gl.constexpr,
                       TOP_K_PAD: gl.constexpr, SLOTS_PAD: gl.constexpr, NORM_TOPK: gl.constexpr,
                       BATCH: gl.constexpr, ROUTER_PARTS: gl.constexpr, num_warps: gl.constexpr):
    """route_if_last_gpu in Gluon."""
    rg.cta_barrier()            # every thread's share precedes the count
    arrived = gl.atomic_add(route_arrivals + sparse_layer, 1, sem="acq_rel", scope="gpu")
    if (arrived + 1) % ROUTER_PARTS == 0:
        route_ring(sparse_layer, 1, n, router_logits, router_partial, router_sumsq, route_expert, route_weight,
                   route_slot, route_unique, route_count, route_history, H, EPS, EXPERTS, EXPERTS_PAD, TOP_K,
                   TOP_K_PAD, SLOTS_PAD, NORM_TOPK, BATCH, ROUTER_PARTS, num_warps)


def route_if_last(ctx, sparse_layer: int) -> None:
    """route_if_last_gpu's semantics: the o_proj tile that adds a sparse layer's last share of the step routes it."""
    arrived = ctx.buf["route_arrivals"][sparse_layer]
    arrived += 1
    if int(arrived) % ctx.buf["router_partial"].shape[0] == 0:
        route(ctx, sparse_layer, 1)


class Route(TaskKind):
    name = "route"
    # sparse_layer: the layer's index among the sparse ones (its route_history row); partials: 1 where the o_proj
    # tiles added shares of the logits (GraphConfig.router_partials 1), 0 where router tiles wrote them
    args = ("sparse_layer", "partials")
    gpu = route_gpu
    ring = route_ring

    def cost(self, shape, layer, a):
        return shape.router_shares * shape.batch * (shape.spec.num_experts + 1) * 4

    def run(self, ctx, layer, a):
        route(ctx, *a)


def route(ctx, sparse_layer: int, partials: int) -> None:
    """The route task's semantics: every row's choices of the sparse layer, its leading slots and their count."""
    n, top_k = ctx.num_rows, ctx.spec.experts_per_token
    weights, experts = choose(router_logits(ctx, partials), top_k, ctx.spec.norm_topk_prob)
    ctx.buf["route_weight"][:n] = weights
    ctx.buf["route_expert"][:n] = experts
    ctx.buf["route_history"][sparse_layer, :n] = experts
    flat = experts.flatten()
    first = (flat[:, None] == flat[None, :]).int().argmax(dim=1)
    ctx.buf["route_slot"][:n] = first.view(n, top_k)
    unique = (first == torch.arange(len(flat), device=flat.device)).nonzero().flatten()
    ctx.buf["route_unique"][:len(unique)] = unique
    ctx.buf["route_count"][0] = len(unique)
