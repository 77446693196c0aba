"""Per-task timings recorded by the megakernel (--trace): a Chrome/Perfetto trace and a breakdown by type."""
from __future__ import annotations

import collections
import json
import statistics

import torch

from distmk.graph.table import A2, LAYER, SIGNAL, TYPE, WAIT
from distmk.tasks import TASK_KINDS, TYPE_ID


def chrome_trace(table, timings: torch.Tensor, rank: int = 0) -> dict:
    """timings: [tasks, 4] int64 (wait start ns, start ns, end ns, SM) from one step. A task's wait shows
    as a slice of its own ("wait:<type>") before the task."""
    t0 = int(timings[:, 0].min())
    events = []
    for task, (waited, start, end, sm) in enumerate(timings.tolist()):
        kind = TASK_KINDS[int(table.tasks[task, TYPE])].name
        args = dict(zip(("layer", "a0", "a1", "a2", "a3"), table.tasks[task, 1:6].tolist()))
        if start > waited:
            events.append({"name": f"wait:{kind}", "cat": "wait", "ph": "X", "pid": rank, "tid": int(sm),
                           "ts": (waited - t0) / 1e3, "dur": (start - waited) / 1e3, "args": {"task": task}})
        events.append({"name": kind, "cat": kind, "ph": "X", "pid": rank, "tid": int(sm),
                       "ts": (start - t0) / 1e3, "dur": (end - start) / 1e3, "args": {"task": task, **args}})
    return {"traceEvents": events, "displayTimeUnit": "ns"}


def wait_summary(table, timings: torch.Tensor) -> dict:
    """Worker time spent running tasks and waiting for their events, in ns, summed over workers; `peer_wait`
    is the part spent by tasks that wait on other ranks (an exchange's arrivals)."""
    kinds = [TASK_KINDS[int(t)] for t in table.tasks[:, TYPE].tolist()]
    wait = (timings[:, 1] - timings[:, 0]).tolist()
    run = (timings[:, 2] - timings[:, 1]).tolist()
    span = int(timings[:, 2].max() - timings[:, 0].min())
    peer = sum(w for w, k in zip(wait, kinds) if k.communicates and not k.signals_all_ranks)
    return {"span_ns": span, "workers": table.num_workers, "run_ns": sum(run), "wait_ns": sum(wait),
            "peer_wait_ns": peer, "peer_wait_fraction": peer / (span * table.num_workers) if span else 0.0}


def exchange_tiles(table) -> list[tuple[int, int, int]]:
    """(push, reduce, output) of each all-reduce tile on this rank: the row-parallel tile that pushed its partial, the
    allreduce task that waits for every rank's push (its event), and which row-parallel output of the step it is."""
    signaller = {int(s): t for t, s in enumerate(table.tasks[:, SIGNAL].tolist()) if s >= 0}
    allreduce = TYPE_ID["allreduce"]
    return [(signaller[int(table.tasks[t, WAIT])], t, int(table.tasks[t, A2]))
            for t in (table.tasks[:, TYPE] == allreduce).nonzero().flatten().tolist()]


def exposed_allreduce_ns(table, timings: torch.Tensor) -> float | None:
    """Mean over the step's all-reduces (one per row-parallel output) of how long after this rank pushed its last
    partial tile the last reduced tile was written: the all-reduce time the schedule did not hide."""
    pushed, reduced = collections.defaultdict(int), collections.defaultdict(int)
    for push, reduce, output in exchange_tiles(table):
        pushed[output] = max(pushed[output], int(timings[push, 2]))
        reduced[output] = max(reduced[output], int(timings[reduce, 2]))
    gaps = [reduced[s] - pushed[s] for s in pushed]
    return sum(gaps) / len(gaps) if gaps else None


def push_to_consume_ns(table, timings: torch.Tensor) -> dict | None:
    """Each all-reduce tile's latency on this rank: from the end of the tile that pushed its partial to the start
    of the reduction (allreduce, which starts once every rank's partial arrived); median and largest over the
    step's tiles, in ns. None without exchanges (tp=1)."""
    gaps = [int(timings[reduce, 1]) - int(timings[push, 2]) for push, reduce, _ in exchange_tiles(table)]
    return {"median": statistics.median(gaps), "max": max(gaps), "tiles": len(gaps)} if gaps else None


def breakdown(table, timings: torch.Tensor) -> str:
    """Time per task type (running, and waiting for its event), summed over workers, and the step's span."""
    busy, waiting, count = collections.Counter(), collections.Counter(), collections.Counter()
    for task, (waited, start, end, _) in enumerate(timings.tolist()):
        kind = TASK_KINDS[int(table.tasks[task, TYPE])].name
        busy[kind] += end - start
        waiting[kind] += start - waited
        count[kind] += 1
    summary = wait_summary(table, timings)
    total = sum(busy.values())
    lines = [f"step span {summary['span_ns'] / 1e3:.1f} us over {summary['workers']} workers; running "
             f"{total / 1e3:.1f} us, waiting {summary['wait_ns'] / 1e3:.1f} us (on peers "
             f"{100 * summary['peer_wait_fraction']:.1f}% of workers x span), summed over workers"]
    for kind, ns in busy.most_common():
        lines.append(f"  {kind:<12} {count[kind]:>6} tasks  run {ns / 1e3:>9.1f} us {100 * ns / total:5.1f}%  "
                     f"{ns / count[kind] / 1e3:7.2f} us/task   wait {waiting[kind] / 1e3:>9.1f} us")
    return "\n".join(lines)


def phase_timeline(table, timings: torch.Tensor) -> str:
    """A layer's phases (its task types, in the order they start), averaged over the middle layers (the first two
    and last two left out): when each phase's tasks start running (past their wait: first, median, last) and end
    (median, last), in µs from the previous phase's last end, and a task's mean running time. A phase's last end
    is where the next phase may begin; its first start after that end is the cost of the hand-over. `late` counts
    a layer's tasks that began waiting after that end (their event was complete or nearly), and `late wait` is
    their median from the wait's beginning to the start: what a wait costs a worker that need not wait at all."""
    kinds = [TASK_KINDS[int(t)].name for t in table.tasks[:, TYPE].tolist()]
    layers = table.tasks[:, LAYER].tolist()
    times = collections.defaultdict(list)           # (layer, kind) -> [(wait, start, end)]
    for task, (waited, start, end, _) in enumerate(timings.tolist()):
        times[(layers[task], kinds[task])].append((waited, start, end))
    middle = sorted({layer for layer in layers if 2 <= layer < max(layers) - 1})
    if not middle:
        return "phase timeline: too few layers"
    order = sorted({k for (layer, k) in times if layer == middle[0]},
                   key=lambda k: statistics.median(s for _, s, _ in times[(middle[0], k)]))
    rows, late = collections.defaultdict(list), collections.defaultdict(list)
    for layer in middle:
        prev = max(e for (ll, _), ts in times.items() if ll == layer - 1 for _, _, e in ts)
        for kind in order:
            starts = sorted(s - prev for _, s, _ in times[(layer, kind)])
            ends = sorted(e - prev for _, _, e in times[(layer, kind)])
            rows[kind].append((starts[0], statistics.median(starts), starts[-1], statistics.median(ends), ends[-1],
                               statistics.mean(e - s for _, s, e in times[(layer, kind)])))
            late[kind].append([s - w for w, s, _ in times[(layer, kind)] if w > prev])
            prev += ends[-1]
    lines = [f"phase timeline, layers {middle[0]}..{middle[-1]} averaged, µs from the previous phase's last end:",
             f"  {'phase':<12} {'tasks':>5} {'start first':>11} {'median':>7} {'last':>7} {'end median':>10} "
             f"{'last':>7} {'run/task':>8} {'late':>6} {'late wait':>9}"]
    period = 0.0
    for kind in order:
        first, mid, last, end_mid, end_last, run = (statistics.mean(r[i] for r in rows[kind]) / 1e3 for i in range(6))
        period += end_last
        waits = [statistics.median(w) for w in late[kind] if w]
        late_wait = f"{statistics.mean(waits) / 1e3:.2f}" if waits else "-"
        lines.append(f"  {kind:<12} {len(times[(middle[0], kind)]):>5} {first:>11.2f} {mid:>7.2f} {last:>7.2f} "
                     f"{end_mid:>10.2f} {end_last:>7.2f} {run:>8.2f} "
                     f"{statistics.mean(len(w) for w in late[kind]):>6.1f} {late_wait:>9}")
    lines.append(f"  layer period {period:.2f} µs")
    return "\n".join(lines)


def write_trace(path: str, table, timings: torch.Tensor, rank: int = 0) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(table, timings, rank), f)
