"""Per-task timings recorded by the megakernel (--trace): a Chrome/Perfetto trace and a breakdown by type."""
from __future__ import annotations

import collections
import json

import torch

from distmk.graph.table import TYPE
from distmk.tasks import TASK_KINDS


def chrome_trace(table, timings: torch.Tensor, rank: int = 0) -> dict:
    """timings: [tasks, 3] int64 (start ns, end ns, SM) from one step."""
    t0 = int(timings[:, 0].min())
    events = []
    for task, (start, end, sm) in enumerate(timings.tolist()):
        kind = TASK_KINDS[int(table.tasks[task, TYPE])].name
        args = dict(zip(("layer", "a0", "a1", "a2", "a3"), table.tasks[task, 1:6].tolist()))
        events.append({"name": kind, "cat": kind, "ph": "X", "pid": rank, "tid": int(sm),
                       "ts": (start - t0) / 1e3, "dur": (end - start) / 1e3, "args": {"task": task, **args}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def breakdown(table, timings: torch.Tensor) -> str:
    """Time per task type, summed over workers, and the step's span."""
    busy = collections.Counter()
    count = collections.Counter()
    for task, (start, end, _) in enumerate(timings.tolist()):
        kind = TASK_KINDS[int(table.tasks[task, TYPE])].name
        busy[kind] += end - start
        count[kind] += 1
    span = int(timings[:, 1].max() - timings[:, 0].min())
    total = sum(busy.values())
    lines = [f"step span {span / 1e3:.1f} us; task time summed over workers {total / 1e3:.1f} us"]
    for kind, ns in busy.most_common():
        lines.append(f"  {kind:<12} {count[kind]:>6} tasks  {ns / 1e3:>10.1f} us  {100 * ns / total:5.1f}%  "
                     f"{ns / count[kind] / 1e3:7.2f} us/task")
    return "\n".join(lines)


def write_trace(path: str, table, timings: torch.Tensor, rank: int = 0) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(table, timings, rank), f)
