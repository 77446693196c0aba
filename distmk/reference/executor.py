"""The CPU reference executor: runs a TaskTable task by task with torch, as W workers would.

It walks the worker queues exactly as the GPU kernel does: a worker runs the task at the head of its
queue once the task's event counter reaches `epoch * need`, then bumps the event it signals. Workers
take turns (each runs until it must wait), so the order tasks run in depends on W and on the schedule;
the results must not. A step where no worker can move is a deadlock and raises, naming who waits on what.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from distmk.errors import DistmkError, GraphError
from distmk.graph.lowering import hidden_tile_rows
from distmk.graph.table import A0, LAYER, SIGNAL, TYPE, WAIT, TaskTable
from distmk.tasks import TASK_KINDS
from distmk.graph.workspace import allocate_workspace


@dataclass
class StepContext:
    """Everything a task's `run` may touch: the rank's weights, buffers, KV cache and this step's inputs."""
    spec: object
    plan: object
    weights: object
    buf: dict
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_size: int
    kv_splits: int
    o_proj_rows: int                  # rows of an o_proj tile (a router share's index: row0 // o_proj_rows)
    comm: object
    dtype: torch.dtype
    tokens: torch.Tensor = None       # [rows] int64
    positions: torch.Tensor = None    # [rows] int64
    block_table: torch.Tensor = None  # [rows, max_blocks] int64
    num_rows: int = 0
    wait: int = -1                    # the running task's events (exchanges are keyed by them)
    signal: int = -1
    published: dict = None            # what this rank's push tasks made visible to the others, by event
    fused_attn_reduce: int = 0        # GraphConfig's: the last split of an attention group combines it
    fused_route: int = 0              # GraphConfig's: the o_proj tile that adds a layer's last share routes it


class ReferenceExecutor:
    def __init__(self, table: TaskTable, spec, weights, kv_cache, comm, dtype):
        self.table, self.epoch = table, 0
        config, plan = table.config, weights.plan
        self.device = device = weights.embed.device
        self.ctx = StepContext(
            spec=spec, plan=plan, weights=weights,
            buf=allocate_workspace(spec, plan, config, dtype, device),
            k_cache=kv_cache.k, v_cache=kv_cache.v, block_size=kv_cache.block_size,
            kv_splits=config.kv_splits,
            o_proj_rows=hidden_tile_rows(spec, config), comm=comm, dtype=dtype, published={},
            fused_attn_reduce=config.fused_attn_reduce, fused_route=config.fused_route)
        self.rows = [(TASK_KINDS[r[TYPE]], r[LAYER], tuple(r[A0:A0 + len(TASK_KINDS[r[TYPE]].args)]),
                      r[WAIT], r[SIGNAL]) for r in table.tasks.tolist()]
        # an exchange's event counts one signal per rank; here the other ranks meet inside comm.gather
        self.signal_step = [comm.world if kind.signals_every_rank(args) else 1 for kind, _, args, *_ in self.rows]
        self.need = table.event_need.tolist()
        self.queues = [table.worker_queue(w) for w in range(table.num_workers)]
        self.counters = [0] * len(self.need)

    def step_rows(self, rows, wait: bool = True) -> dict:
        """A step of int64 [rows, 2 + blocks] host rows as runtime.engine.pack_rows lays them out (token,
        position, block table), as the triton executor takes them too."""
        rows = torch.from_numpy(rows).to(self.device)
        return self.step(rows[:, 0], rows[:, 1], rows[:, 2:], wait)

    def step_next(self, wait: bool = True) -> dict:
        """The next greedy decode step of the last step's rows: each row fed the token it chose, one position on."""
        c = self.ctx
        return self.step(c.buf["next_token"][:c.num_rows].clone(), c.positions + 1, c.block_table, wait)

    def next_tokens(self, n: int) -> list[int]:
        """The greedy tokens of the first n rows of the last step."""
        return self.ctx.buf["next_token"][:n].tolist()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
             wait: bool = True) -> dict:
        """Run one step over len(tokens) active rows; returns the workspace (next_token, logits, ...). It runs
        to the end whatever `wait` says (the triton executor's may return before the device is done)."""
        n = len(tokens)
        if not 1 <= n <= self.table.config.batch:
            raise DistmkError(f"a step takes 1..{self.table.config.batch} rows, got {n}")
        c = self.ctx
        c.tokens, c.positions, c.block_table, c.num_rows = tokens, positions, block_table, n
        self.epoch += 1
        heads = [0] * len(self.queues)
        remaining = len(self.rows)
        while remaining:
            moved = 0
            for w, q in enumerate(self.queues):
                while heads[w] < len(q):
                    task = q[heads[w]]
                    kind, layer, args, wait, signal = self.rows[task]
                    if wait >= 0 and self.counters[wait] < self.epoch * self.need[wait]:
                        break
                    c.wait, c.signal = wait, signal
                    kind.run(c, layer, args)
                    if signal >= 0:
                        self.counters[signal] += self.signal_step[task]
                    heads[w] += 1
                    moved += 1
            remaining -= moved
            if not moved:
                raise GraphError("deadlock: " + "; ".join(self._blocked(heads)))
        return c.buf

    def _blocked(self, heads) -> list[str]:
        out = []
        for w, q in enumerate(self.queues):
            if heads[w] < len(q):
                t = q[heads[w]]
                kind, _, _, e, _ = self.rows[t]
                out.append(f"worker {w} task {t} ({kind.name}) waits on event "
                           f"{e} '{self.table.event_names[e]}' at {self.counters[e]}/{self.epoch * self.need[e]}")
        return out[:4]
