"""The activation buffers that tasks read and write, by name: one set per rank, reused every step. Declared
once (WORKSPACE): the reference executor allocates them, and the megakernels take them as arguments by these
names (kernels/interface.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from distmk.graph.lowering import num_lm_tiles, router_shares


@dataclass(frozen=True)
class Dims:
    """The sizes a buffer's shape is made of."""
    batch: int
    layers: int
    hidden: int
    head_dim: int
    heads: int          # this rank's query heads
    kv_heads: int
    group: int          # query heads per key/value head
    inter: int
    vocab: int          # this rank's vocabulary slice
    kv_splits: int
    lm_tiles: int
    experts: int = 0        # experts of a sparse layer (0: a dense model)
    top_k: int = 0          # experts each token picks
    expert_inter: int = 0   # this rank's rows of each expert
    sparse_layers: int = 0  # layers with experts
    router_parts: int = 1   # o_proj tiles that add shares of the gate's logits (GraphConfig.router_partials 1)


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: Callable[[Dims], tuple]
    dtype: str          # "float32", "int64", or "act": the activations' dtype
    doc: str


WORKSPACE = (
    Buffer("x", lambda d: (d.batch, d.hidden), "float32", "residual stream, kept in float32"),
    Buffer("xs", lambda d: (d.batch, d.hidden), "act",
           "the residual stream times the weight of the RMSNorm that reads it next, rounded once: the input of the "
           "tiles that read the normed stream (tasks/base.py normed_stream)"),
    Buffer("qk_raw", lambda d: (d.batch, d.heads + d.kv_heads, d.head_dim), "float32",
           "q/k heads as the QKV projection gives them (attention finishes them)"),
    Buffer("attn_o", lambda d: (d.batch, d.kv_heads, d.kv_splits, d.group, d.head_dim), "float32",
           "split-KV partial outputs"),
    Buffer("attn_m", lambda d: (d.batch, d.kv_heads, d.kv_splits, d.group), "float32", "split-KV running maxima"),
    Buffer("attn_l", lambda d: (d.batch, d.kv_heads, d.kv_splits, d.group), "float32", "split-KV running sums"),
    Buffer("attn", lambda d: (d.batch, d.heads * d.head_dim), "act", "attention output, heads concatenated"),
    Buffer("attn_count", lambda d: (d.layers, d.batch, d.kv_heads, d.group), "int64",
           "splits of each group's attention ended, kv_splits more a step (fused_attn_reduce: the task that makes "
           "it a multiple of kv_splits combines the group); zeroed after an aborted step"),
    Buffer("partial", lambda d: (d.batch, d.hidden), "float32", "this rank's row-parallel partial sum"),
    Buffer("h", lambda d: (d.batch, d.inter), "act", "silu(gate) * up"),
    Buffer("logits", lambda d: (d.batch, d.vocab), "float32", "this rank's vocabulary slice"),
    Buffer("tile_max", lambda d: (d.batch, d.lm_tiles), "float32", "each lm_head tile's maximum logit"),
    Buffer("tile_arg", lambda d: (d.batch, d.lm_tiles), "int64", "and its token id"),
    Buffer("next_token", lambda d: (d.batch,), "int64", "the greedy token of each row"),
    # mixture of experts (tasks/router.py, tasks/route.py): slot b * top_k + k is row b's k-th choice
    Buffer("router_logits", lambda d: (d.batch, max(1, d.experts)), "float32", "the gate's logits of each expert"),
    Buffer("router_partial", lambda d: (d.router_parts, d.batch, max(1, d.experts)), "float32",
           "each o_proj tile's share of the gate's logits, before the RMSNorm's scale (router_partials 1)"),
    Buffer("router_sumsq", lambda d: (d.router_parts, d.batch), "float32",
           "and of the residual stream's sum of squares, of which the route task takes that scale"),
    Buffer("route_arrivals", lambda d: (max(1, d.sparse_layers),), "int64",
           "o_proj tiles that added a share of each sparse layer's logits, router_parts more a step (fused_route: the "
           "tile that makes it a multiple of router_parts routes the layer); zeroed after an aborted step"),
    Buffer("route_expert", lambda d: (d.batch, max(1, d.top_k)), "int64", "the expert of each slot"),
    Buffer("route_weight", lambda d: (d.batch, max(1, d.top_k)), "float32", "its routing weight"),
    Buffer("route_slot", lambda d: (d.batch, max(1, d.top_k)), "int64",
           "the first slot of the step that chose the same expert (it leads: runs it for every row that chose it)"),
    Buffer("route_unique", lambda d: (d.batch * max(1, d.top_k),), "int64",
           "the leading slots in increasing order, one per distinct expert of the step (the first route_count)"),
    Buffer("route_count", lambda d: (1,), "int64", "how many distinct experts the step chose"),
    Buffer("expert_h", lambda d: (d.batch * max(1, d.top_k), d.batch, max(1, d.expert_inter)), "act",
           "silu(gate) * up of a leading slot's expert, for every row"),
    Buffer("expert_out", lambda d: (d.batch, max(1, d.top_k), d.hidden), "float32",
           "each slot's expert output (this rank's partial sum), before the weighted combine"),
    Buffer("route_history", lambda d: (max(1, d.sparse_layers), d.batch, max(1, d.top_k)), "int64",
           "every sparse layer's route_expert of the last step, which only the route task writes: the experts the "
           "step read (benchmarks/decode.py), its routing (tests)"),
)


def allocate_workspace(spec, plan, config, dtype, device) -> dict:
    """WORKSPACE's buffers for a table compiled with `config` (its batch, attention splits and lm_head tiles)."""
    dims = Dims(batch=config.batch, layers=spec.num_layers, hidden=spec.hidden_size, head_dim=spec.head_dim,
                heads=plan.num_heads, kv_heads=plan.num_kv_heads, group=plan.group, inter=plan.inter, vocab=plan.vocab,
                kv_splits=config.kv_splits, lm_tiles=num_lm_tiles(plan, config), experts=spec.num_experts,
                top_k=spec.experts_per_token, expert_inter=plan.expert_inter, sparse_layers=len(spec.moe_layers),
                router_parts=router_shares(spec, config))
    dtypes = {"float32": torch.float32, "int64": torch.int64, "act": dtype}
    return {b.name: torch.zeros(b.shape(dims), dtype=dtypes[b.dtype], device=device) for b in WORKSPACE}
