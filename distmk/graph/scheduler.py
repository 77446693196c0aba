"""Static scheduler: tasks → W worker queues, balancing estimated time, provably free of deadlock.

Cost model: a task takes `overhead + bytes / per-worker bandwidth` (the GPU's HBM bandwidth,
GraphConfig.hbm_bytes_per_s, shared by all workers), plus a fixed latency for tasks that talk to other
ranks. List scheduling walks tasks in their topological emission order and gives each to the worker
where it can finish first. Because every queue is then ordered by one global topological order, the
lowest unfinished task is always runnable; the same property is checked independently on the result
(`check_deadlock_free`).
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from distmk.errors import GraphError
from distmk.graph.table import SIGNAL, TYPE, WAIT, TaskTable
from distmk.tasks import TASK_KINDS

TASK_OVERHEAD_S = 0.5e-6   # fetch task, wait on the event, signal
COMM_LATENCY_S = 4.5e-6    # one in-kernel NVSHMEM exchange, measured on 2x H200 NVLink


def task_seconds(tasks: torch.Tensor, cost: torch.Tensor, config) -> np.ndarray:
    per_worker_bw = config.hbm_bytes_per_s / config.workers
    comm = np.array([TASK_KINDS[t].communicates for t in tasks[:, TYPE].tolist()], dtype=bool)
    return TASK_OVERHEAD_S + cost.numpy() / per_worker_bw + comm * COMM_LATENCY_S


def schedule(tasks: torch.Tensor, event_need: torch.Tensor, cost: torch.Tensor, event_names: list[str],
             config) -> TaskTable:
    W = config.workers
    dur = task_seconds(tasks, cost, config)
    wait = tasks[:, WAIT].numpy()
    signal = tasks[:, SIGNAL].numpy()
    event_done = np.zeros(len(event_need))
    free = np.zeros(W)
    assignment = np.empty(len(tasks), dtype=np.int64)
    for t in range(len(tasks)):
        ready = event_done[wait[t]] if wait[t] >= 0 else 0.0
        start = np.maximum(free, ready)
        w = int(np.argmin(start))        # earliest start = earliest finish (same task duration everywhere)
        free[w] = start[w] + dur[t]
        assignment[t] = w
        if signal[t] >= 0:
            event_done[signal[t]] = max(event_done[signal[t]], free[w])
    order = np.argsort(assignment, kind="stable")           # per worker, in emission (topological) order
    counts = np.bincount(assignment, minlength=W)
    queue_ptr = np.concatenate([[0], np.cumsum(counts)])
    table = TaskTable(tasks=tasks, event_need=event_need,
                      queue_ptr=torch.from_numpy(queue_ptr).to(torch.int32),
                      queue=torch.from_numpy(order).to(torch.int32), cost=cost,
                      event_names=event_names, config=config)
    check_deadlock_free(table)
    table.schedule = {
        "makespan_s": float(free.max()),
        "critical_path_s": critical_path(tasks, len(event_need), dur),
        "busy_s_min": float(np.bincount(assignment, weights=dur, minlength=W).min()),
        "busy_s_max": float(np.bincount(assignment, weights=dur, minlength=W).max()),
    }
    return table


def critical_path(tasks: torch.Tensor, num_events: int, dur: np.ndarray) -> float:
    """Longest chain of dependent tasks, in seconds, with unlimited workers (tasks are topologically sorted)."""
    event_done = np.zeros(num_events)
    finish = 0.0
    for t, (w, s) in enumerate(zip(tasks[:, WAIT].tolist(), tasks[:, SIGNAL].tolist())):
        end = (event_done[w] if w >= 0 else 0.0) + dur[t]
        finish = max(finish, end)
        if s >= 0:
            event_done[s] = max(event_done[s], end)
    return float(finish)


def check_deadlock_free(table: TaskTable) -> None:
    """Every task is queued exactly once, and dependencies plus queue order form no cycle.

    Nodes are tasks and events; edges go signalling task → event → waiting task, and from each task to
    the next in its queue. A cycle is exactly a set of workers that can each wait on a task queued
    behind another's; Kahn's algorithm finds whether one exists.
    """
    T, E = table.num_tasks, len(table.event_need)
    queued = torch.bincount(table.queue.long(), minlength=T)
    if table.queue.numel() != T or bool((queued != 1).any()):
        raise GraphError(f"queues must hold every task exactly once (missing or repeated: "
                         f"{(queued != 1).nonzero().flatten()[:5].tolist()})")
    succ = [[] for _ in range(T + E)]
    indeg = np.zeros(T + E, dtype=np.int64)

    def edge(a, b):
        succ[a].append(b)
        indeg[b] += 1

    for t, (w, s) in enumerate(zip(table.tasks[:, WAIT].tolist(), table.tasks[:, SIGNAL].tolist())):
        if s >= 0:
            edge(t, T + s)
        if w >= 0:
            edge(T + w, t)
    for w in range(table.num_workers):
        q = table.worker_queue(w)
        for a, b in zip(q, q[1:]):
            edge(a, b)
    ready = deque(np.flatnonzero(indeg == 0).tolist())
    seen = 0
    while ready:
        n = ready.popleft()
        seen += 1
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if seen != T + E:
        stuck = [n for n in range(T) if indeg[n] > 0][:5]
        raise GraphError(f"schedule can deadlock: tasks {stuck} wait, directly or through their queue, "
                         f"on tasks queued behind them")
