"""Lowering: one decode step of one tensor-parallel rank → tile tasks joined by counted events.

A consumer waits only on the event of the producer tiles it reads: an all-reduce tile for the one matmul
tile that produced its slice, attention for the QKV tiles (row ranges of Wqkv that cross heads). The
tiles that read the RMSNorm of the residual stream (QKV, gate/up, lm_head) take its scale from the whole
stream (tasks/base.py normed_stream), so they wait for every tile of the stream; no norm task stands between
two phases. A sparse (mixture-of-experts) layer's MLP is router tiles, a route task, expert tiles that split the
step's distinct experts' rows among themselves at run time, and combine tiles in the place of the down tiles,
all-reduced the same way. Tasks are emitted in a topological order, which the scheduler keeps within each worker queue.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from distmk.errors import GraphError
from distmk.graph.hardware import DEFAULT_HBM_BYTES_PER_S, DEFAULT_WORKERS
from distmk.graph.table import COLUMNS, TaskTable
from distmk.models.shard import ShardPlan
from distmk.models.spec import ModelSpec
from distmk.tasks import TASK_KINDS, TYPE_ID
from distmk.tasks.attention import attention_heads
from distmk.tasks.base import ADD_RESIDUAL, PUSH_PARTIAL, WRITE_PARTIAL, StepShape


@dataclass(frozen=True)
class GraphConfig:
    batch: int = 1            # most rows (tokens) one step processes; fewer may be active at run time
    # tiling (cli.add_graph_args makes a flag of each, with its help)
    kv_splits: int = field(default=0, metadata={"help": "attention splits along the KV length; 0 = one split "
                                                        "per worker, at most 16"})
    tile_rows: int = field(default=0, metadata={"help": "output rows of a QKV / o_proj / gate_up / down tile; 0 = "
                                                        "about one tile per worker"})
    lm_tile_rows: int = field(default=0, metadata={"help": "output rows of an lm_head tile; 0 = about one tile per "
                                                           "worker"})
    router_partials: int = field(default=0, metadata={
        "help": "a sparse layer's gate logits: 1 = each o_proj tile adds its rows' share (no router phase; tp=1), "
                "2 = router tiles; 0 = 1 at tp=1 and batch 1 when the shares are at most 64 KB"})
    # 1: the combine rides on the last split's task, saving a phase boundary a layer
    fused_attn_reduce: int = field(default=1, metadata={
        "help": "1 = the attention task that ends a group's splits last combines them (fixed order, no attn_reduce "
                "phase); 0 = attn_reduce tasks"})
    # 1: routing in the tile that adds the last share saves the route phase's boundary a sparse layer
    fused_route: int = field(default=1, metadata={
        "help": "1 = where the o_proj tiles add the gate's shares (router_partials 1), the tile that adds a sparse "
                "layer's last share routes it (no route phase); 0 = route tasks"})
    workers: int = DEFAULT_WORKERS  # worker queues (one per SM on the GPU: graph/hardware.py)
    context: int = 512        # expected context length, for the cost model only
    dtype_bytes: int = 2      # element size of weights and activations, for the cost model
    hbm_bytes_per_s: float = DEFAULT_HBM_BYTES_PER_S  # the workers' shared HBM bandwidth, for the cost model

    def __post_init__(self):
        for name in ("batch", "workers", "context", "dtype_bytes", "hbm_bytes_per_s"):
            if getattr(self, name) < 1:
                raise GraphError(f"GraphConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kv_splits", "tile_rows", "lm_tile_rows", "router_partials"):
            if getattr(self, name) < 0:
                raise GraphError(f"GraphConfig.{name} must be >= 0 (0 = automatic), got {getattr(self, name)}")
        for name in ("fused_attn_reduce", "fused_route"):
            if getattr(self, name) not in (0, 1):
                raise GraphError(f"GraphConfig.{name} must be 0 or 1, got {getattr(self, name)}")

    def resolved(self, spec: ModelSpec, plan: ShardPlan) -> "GraphConfig":
        """Automatic choices made concrete. kv_splits: enough splits that every worker gets an attention task
        (at most 16), so attention is one short pass over the keys instead of a long serial one on a few
        workers. fused_route: only where the o_proj tiles add the shares (router_partials 1)."""
        tasks_per_split = self.batch * plan.num_kv_heads * (plan.group // attention_heads(plan.group))
        splits = self.kv_splits or max(1, min(16, self.workers // tasks_per_split))
        partials = self.router_partials_choice(spec, plan)
        return dataclasses.replace(self, kv_splits=splits, router_partials=partials,
                                   fused_route=int(self.fused_route and partials == 1))

    def router_partials_choice(self, spec: ModelSpec, plan: ShardPlan) -> int:
        """router_partials made concrete (see tasks/router.py for what the o_proj tiles add). At tp > 1 an o_proj
        tile holds a partial sum, not the residual stream's rows, so only router tiles can do it there. The
        route task sums every tile's share of a row, one row after another, so the shares serve one row of at
        most 64 KB (qwen3-30b-a3b: 128 tiles x 128 experts). At batch 1 saving the router phase wins; at batch 8
        summing eight rows' shares one after another costs more than the phase."""
        if self.router_partials > 2:
            raise GraphError(f"GraphConfig.router_partials must be 0, 1 or 2, got {self.router_partials}")
        if self.router_partials == 1 and plan.tp > 1 and spec.moe_layers:
            raise GraphError("router_partials=1 needs tp=1: at tp > 1 an o_proj tile holds this rank's partial sum")
        if self.router_partials:
            return self.router_partials
        shares = len(hidden_tiles(spec, self)) * self.batch * spec.num_experts * 4
        return 1 if plan.tp == 1 and self.batch == 1 and spec.moe_layers and shares <= 64 * 1024 else 2

    def rows_per_tile(self, total: int, size: int) -> int:
        """`size`, or when 0 the height that cuts `total` rows into at most one tile per worker (at least 16
        rows), so that every worker has a share of each matmul. Not rounded up to a multiple of 16: that
        left a fifth of the workers without a gate/up tile (7168 rows: 112 tiles of 64 rows, not 131 of 55)."""
        return size or max(16, -(-total // self.workers))

    def expert_parts(self, rows: int, slots: int) -> int:
        """Tiles of a sparse layer's expert phase (gate/up: rows = an expert's width on this rank, down: the hidden
        size), which cut the step's distinct experts' rows laid end to end at run time (tasks/route.py): with
        tile_rows, tiles of at most tile_rows rows when every one of the `slots` leads; when 0, workers // slots
        tiles for each slot (at least one, at least 16 rows each), so that when every slot leads (batch 1) each
        tile is one expert's 1/(workers // slots), none crosses an expert and the phase is one wave over the
        workers. Cutting slots x rows as one (rows_per_tile) gave qwen3-30b-a3b at batch 1 136 tiles for 132
        workers, and four workers a second tile each in both expert phases."""
        if self.tile_rows:
            return -(-slots * rows // self.tile_rows)
        return slots * max(1, min(self.workers // slots, -(-rows // 16)))


class GraphBuilder:
    """Collects tasks and events; checks that every event gets exactly the signals it waits for."""

    def __init__(self):
        self.rows: list[list[int]] = []
        self.event_names: list[str] = []
        self.event_need: list[int] = []

    def event(self, name: str, need: int) -> int:
        self.event_names.append(name)
        self.event_need.append(need)
        return len(self.event_names) - 1

    def task(self, kind: str, layer: int = 0, args: tuple[int, ...] = (), wait: int = -1, signal: int = -1) -> int:
        if len(args) != len(TASK_KINDS[TYPE_ID[kind]].args):
            raise GraphError(f"task {kind} takes args {TASK_KINDS[TYPE_ID[kind]].args}, got {args}")
        self.rows.append([TYPE_ID[kind], layer, *args, *[0] * (4 - len(args)), wait, signal])
        return len(self.rows) - 1

    def tensors(self, tp: int):
        tasks = torch.tensor(self.rows, dtype=torch.int32).reshape(-1, len(COLUMNS))
        need = torch.tensor(self.event_need, dtype=torch.int32)
        signalled = tasks[:, -1] >= 0
        per_signal = torch.tensor([tp if TASK_KINDS[row[0]].signals_every_rank(tuple(row[2:6])) else 1
                                   for row in tasks.tolist()])
        got = torch.bincount(tasks[:, -1][signalled].long(), weights=per_signal[signalled].double(),
                             minlength=len(need)).long()
        bad = (got != need).nonzero().flatten().tolist()
        if bad:
            e = bad[0]
            raise GraphError(f"event {self.event_names[e]} waits for {need[e]} signals but gets {got[e]}")
        return tasks, need


def tiles(total: int, size: int) -> list[tuple[int, int]]:
    return [(r, min(size, total - r)) for r in range(0, total, size)]


def qkv_tiles(spec: ModelSpec, plan: ShardPlan, config: GraphConfig) -> list[tuple[int, int]]:
    """(row0, nrows) of the QKV tiles over this rank's rows of Wqkv (its query, key and value heads)."""
    rows = (plan.num_heads + 2 * plan.num_kv_heads) * spec.head_dim
    return tiles(rows, config.rows_per_tile(rows, config.tile_rows))


def hidden_tile_rows(spec: ModelSpec, config: GraphConfig) -> int:
    """Rows of a row-parallel tile over the hidden size (o_proj, down, moe_combine; the last may have fewer)."""
    return config.rows_per_tile(spec.hidden_size, config.tile_rows)


def hidden_tiles(spec: ModelSpec, config: GraphConfig) -> list[tuple[int, int]]:
    """(row0, nrows) of the row-parallel tiles over the hidden size."""
    return tiles(spec.hidden_size, hidden_tile_rows(spec, config))


def router_shares(spec: ModelSpec, config: GraphConfig) -> int:
    """Shares of the gate's logits a row has (a resolved config): one per o_proj tile with router_partials 1,
    else 1 (the buffers' least size; router tiles write the logits whole)."""
    return len(hidden_tiles(spec, config)) if config.router_partials == 1 else 1


def row_parallel_phase(g: GraphBuilder, spec: ModelSpec, plan: ShardPlan, config: GraphConfig, kind: str, layer: int,
                       wait: int, name: str, extra: tuple[int, ...] = (), exchange: bool | None = None) -> int:
    """o_proj/down/moe_combine tiles (args row0, nrows, mode, *extra) after event `wait`; at tp > 1 each pushes its
    partial sum to every rank and signals its all-reduce's event there, and an allreduce task sums the ranks'
    partials of its slice; returns 'x updated'. `exchange` False leaves the all-reduce out at tp > 1, each tile
    keeping its partial sum (benchmarks/overlap.py: the GEMV alone)."""
    exchange = plan.tp > 1 if exchange is None else exchange
    row_tiles = hidden_tiles(spec, config)
    done = g.event(f"L{layer}.{name}.x", len(row_tiles))
    for row0, nrows in row_tiles:
        if plan.tp == 1:
            g.task(kind, layer, (row0, nrows, ADD_RESIDUAL, *extra), wait=wait, signal=done)
        elif not exchange:
            g.task(kind, layer, (row0, nrows, WRITE_PARTIAL, *extra), wait=wait, signal=done)
        else:
            arrived = g.event(f"L{layer}.{name}.ar{row0}", plan.tp)    # one push from every rank
            g.task(kind, layer, (row0, nrows, PUSH_PARTIAL, *extra), wait=wait, signal=arrived)
            slot = 2 * layer + (kind != "o_proj")      # the MLP's output (down, moe_combine): odd
            g.task("allreduce", layer, (row0, nrows, slot), wait=arrived, signal=done)
    return done


def lower_decode_step(spec: ModelSpec, plan: ShardPlan, config: GraphConfig) -> GraphBuilder:
    config = config.resolved(spec, plan)
    g = GraphBuilder()
    B, S, H = config.batch, config.kv_splits, spec.hidden_size
    hkv = plan.num_kv_heads

    def row_parallel(kind: str, layer: int, wait: int, name: str) -> int:
        """The o_proj tiles of a sparse layer also add their rows' shares of the gate's logits where the config
        says so (router_partials 1: `router_layer`, the layer's index among the sparse ones, else -1)."""
        partials = kind == "o_proj" and layer in spec.moe_layers and config.router_partials == 1
        extra = ((spec.moe_layers.index(layer) if partials else -1),) if kind == "o_proj" else ()
        return row_parallel_phase(g, spec, plan, config, kind, layer, wait, name, extra)

    def sparse_mlp(layer: int, wait: int) -> int:
        """The router tiles (the gate's logits, cut over the experts) unless the o_proj tiles added their shares
        (router_partials 1), the route task (each row's choices and the step's distinct experts,
        tasks/route.py) unless the o_proj tile that adds the last share routes (fused_route), then the expert
        tiles: gate/up, and down once every gate/up tile is done (a down tile may read any expert's expert_h);
        returns 'every expert output stored', which the combine tiles wait for. Each phase's tiles split the
        distinct experts' rows evenly at run time, so they stay balanced when rows share experts
        (GraphConfig.expert_parts says how many)."""
        sparse, slots = spec.moe_layers.index(layer), B * spec.experts_per_token
        logits, partials = wait, int(config.router_partials == 1)
        if not partials:
            router_tiles = tiles(spec.num_experts, config.rows_per_tile(spec.num_experts, config.tile_rows))
            logits = g.event(f"L{layer}.router", len(router_tiles))
            for expert0, nexperts in router_tiles:
                g.task("router", layer, (sparse, expert0, nexperts), wait=wait, signal=logits)
        if config.fused_route:      # the o_proj tiles' event: the last of them routed before it signalled
            routed = wait
        else:
            routed = g.event(f"L{layer}.route", 1)
            g.task("route", layer, (sparse, partials), wait=logits, signal=routed)
        up_parts, down_parts = config.expert_parts(plan.expert_inter, slots), config.expert_parts(H, slots)
        h_done = g.event(f"L{layer}.expert_h", up_parts)
        for part in range(up_parts):
            g.task("expert_gate_up", layer, (part, up_parts, sparse, routed), wait=routed, signal=h_done)
        stored = g.event(f"L{layer}.experts", down_parts)
        for part in range(down_parts):
            g.task("expert_down", layer, (part, down_parts, sparse, routed), wait=h_done, signal=stored)
        return stored

    x_ready = g.event("x.embed", B)
    for b in range(B):
        g.task("embed", 0, (b,), signal=x_ready)
    row_tiles = qkv_tiles(spec, plan, config)
    for layer in range(spec.num_layers):
        # a tile may hold rows of several heads: attention waits for every tile (they end together, one wave)
        qkv_done = g.event(f"L{layer}.qkv", len(row_tiles))
        for row0, nrows in row_tiles:
            g.task("qkv", layer, (row0, nrows), wait=x_ready, signal=qkv_done)
        # a group's query heads may be cut over tasks (attention_heads): each cut has its splits and reduction
        heads = attention_heads(plan.group)
        groups = B * hkv * (plan.group // heads)
        if config.fused_attn_reduce:    # every split signals; the last of a group combines it first (attention.py)
            attn_done = g.event(f"L{layer}.attn", groups * S)
            for b, h, h0, s in itertools.product(range(B), range(hkv), range(0, plan.group, heads), range(S)):
                g.task("attention", layer, (b, h, s, h0), wait=qkv_done, signal=attn_done)
        else:
            attn_done = g.event(f"L{layer}.attn", groups)
            for b, h, h0 in itertools.product(range(B), range(hkv), range(0, plan.group, heads)):
                parts = g.event(f"L{layer}.attn.b{b}.kv{h}" + (f".q{h0}" if heads < plan.group else ""), S)
                for s in range(S):
                    g.task("attention", layer, (b, h, s, h0), wait=qkv_done, signal=parts)
                g.task("attn_reduce", layer, (b, h, h0), wait=parts, signal=attn_done)
        x_mid = row_parallel("o_proj", layer, attn_done, "attn")
        if layer in spec.moe_layers:
            x_ready = row_parallel("moe_combine", layer, sparse_mlp(layer, x_mid), "moe")
            continue
        mlp_tiles = tiles(plan.inter, config.rows_per_tile(plan.inter, config.tile_rows))
        h_done = g.event(f"L{layer}.h", len(mlp_tiles))
        for row0, nrows in mlp_tiles:
            g.task("gate_up", layer, (row0, nrows), wait=x_mid, signal=h_done)
        x_ready = row_parallel("down", layer, h_done, "mlp")
    lm_tiles = tiles(plan.vocab, config.rows_per_tile(plan.vocab, config.lm_tile_rows))
    logits = g.event("logits", len(lm_tiles))
    for i, (row0, nrows) in enumerate(lm_tiles):
        g.task("lm_head", spec.num_layers, (row0, nrows, i), wait=x_ready, signal=logits)
    best = g.event("best_per_rank", plan.tp)
    g.task("argmax_push", spec.num_layers, (), wait=logits, signal=best)
    g.task("argmax", spec.num_layers, (), wait=best, signal=g.event("next_token", 1))
    return g


def num_lm_tiles(plan: ShardPlan, config: GraphConfig) -> int:
    return len(tiles(plan.vocab, config.rows_per_tile(plan.vocab, config.lm_tile_rows)))


def compile_step(spec: ModelSpec, plan: ShardPlan, config: GraphConfig) -> TaskTable:
    """Lower, cost and schedule one decode step into a TaskTable."""
    config = config.resolved(spec, plan)
    return compile_graph(lower_decode_step(spec, plan, config), spec, plan, config)


def compile_graph(builder: GraphBuilder, spec: ModelSpec, plan: ShardPlan, config: GraphConfig) -> TaskTable:
    """Cost and schedule the tasks of `builder` (lowered for a resolved `config`) into a TaskTable."""
    from distmk.graph.scheduler import schedule

    tasks, need = builder.tensors(plan.tp)
    shape = StepShape(spec, plan, config.batch, config.kv_splits, config.context, config.dtype_bytes,
                      config.dtype_bytes, router_shares(spec, config))
    cost = torch.tensor([TASK_KINDS[t[0]].cost(shape, t[1], tuple(t[2:6])) for t in builder.rows],
                        dtype=torch.int64)
    table = schedule(tasks, need, cost, builder.event_names, config)
    table.tp = plan.tp
    return table
