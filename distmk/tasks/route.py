"""The choice of a sparse (mixture-of-experts) layer's experts, for every row, from the gate's logits (the
router tiles', tasks/router.py): softmax in float32 and the top-k experts of each row, their probabilities
renormalised to sum to 1 where the model says so (norm_topk_prob).

A row's k-th choice is slot b * top_k + k. The task writes each slot's expert and weight, and the first
slot of the step that chose the same expert (route_slot): the expert tiles of that slot alone run the expert,
for every row that chose it, so rows that pick the same expert share one stream of its weights, while the
table stays static (tiles of the other slots find they do not lead and return). It also keeps each sparse
layer's choices of the step in route_history (the next layer's route task overwrites route_expert), which
nothing in the step reads: what a benchmark or a test asks of the step afterwards. Replicated under tensor
parallelism: every rank routes every row to the same experts."""
import torch
import triton
import triton.language as tl

from distmk.tasks.base import TaskKind


def choose(logits: torch.Tensor, top_k: int, renormalise: bool):
    """(weights [rows, top_k] float32, experts [rows, top_k] int64) of the gate's logits [rows, experts]: softmax
    in float32, the top_k largest in descending order, renormalised on request (the route task's semantics,
    and the prefill path's)."""
    weights, experts = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def leading_expert(ctx, slot: int) -> int | None:
    """The expert whose tiles `slot` runs this step: its choice if it is the first slot to have chosen it, else
    None (another slot runs it, or the slot's row is not active)."""
    top_k = ctx.spec.experts_per_token
    if slot // top_k >= ctx.num_rows or int(ctx.buf["route_slot"].view(-1)[slot]) != slot:
        return None
    return int(ctx.buf["route_expert"].view(-1)[slot])


@triton.jit
def slot_expert(slot, n, route_expert, route_slot, TOP_K: tl.constexpr):
    """leading_expert on the device: the expert slot runs, or -1."""
    leads = (slot < n * TOP_K) & (tl.load(route_slot + slot) == slot)    # slot < batch * top_k: in bounds
    return tl.where(leads, tl.load(route_expert + slot), -1)


@triton.jit
def route_gpu(sparse_layer, n, router_logits, route_expert, route_weight, route_slot, route_history,
              EXPERTS: tl.constexpr, EXPERTS_PAD: tl.constexpr, TOP_K: tl.constexpr, SLOTS_PAD: tl.constexpr,
              NORM_TOPK: tl.constexpr, BATCH: tl.constexpr):
    """A row at a time: its probabilities, then each expert's rank among them from one [experts, experts]
    comparison (ties to the lower index, as a left-first argmax), and the experts ranked below TOP_K stored at
    their rank's slot. One pass of reductions a row, where picking the top k one argmax at a time took 2k
    dependent reductions over the padded batch."""
    re = tl.arange(0, EXPERTS_PAD)
    for b in range(n):
        logits = tl.load(router_logits + b * EXPERTS + re, mask=re < EXPERTS, other=float("-inf"))
        p = tl.exp(logits - tl.max(logits, axis=0))
        p = tl.where(re < EXPERTS, p / tl.sum(p, axis=0), -1.0)      # padding ranks below every expert
        # above[e, j]: expert j ranks above expert e
        above = (p[None, :] > p[:, None]) | ((p[None, :] == p[:, None]) & (re[None, :] < re[:, None]))
        rank = tl.sum(above.to(tl.int32), axis=1)
        chosen = (rank < TOP_K) & (re < EXPERTS)
        weight = p
        if NORM_TOPK:
            weight = p / tl.sum(tl.where(chosen, p, 0.0), axis=0)
        slot = b * TOP_K + rank
        tl.store(route_expert + slot, re.to(tl.int64), mask=chosen)
        tl.store(route_weight + slot, weight, mask=chosen)
        tl.store(route_history + sparse_layer.to(tl.int64) * BATCH * TOP_K + slot, re.to(tl.int64), mask=chosen)
    rs = tl.arange(0, SLOTS_PAD)
    slots = rs < n * TOP_K
    if n == 1:      # a row's choices are distinct experts: every slot leads (no round trip through memory)
        tl.store(route_slot + rs, rs.to(tl.int64), mask=slots)
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


class Route(TaskKind):
    name = "route"
    args = ("sparse_layer",)    # the layer's index among the sparse ones (its route_history row)
    gpu = route_gpu

    def cost(self, shape, layer, a):
        return shape.batch * shape.spec.num_experts * 4

    def run(self, ctx, layer, a):
        n, top_k = ctx.num_rows, ctx.spec.experts_per_token
        weights, experts = choose(ctx.buf["router_logits"][:n], top_k, ctx.spec.norm_topk_prob)
        ctx.buf["route_weight"][:n] = weights
        ctx.buf["route_expert"][:n] = experts
        ctx.buf["route_history"][a[0], :n] = experts
        flat = experts.flatten()
        ctx.buf["route_slot"][:n] = (flat[:, None] == flat[None, :]).int().argmax(dim=1).view(n, top_k)
