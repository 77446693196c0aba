"""kernels/trace.py's summaries over synthetic timings of a real table (tests/test_gpu.py traces a real step)."""
import torch

from distmk.graph import GraphConfig, compile_step
from distmk.graph.table import LAYER, TYPE
from distmk.kernels.trace import phase_timeline
from distmk.models.presets import PRESETS
from distmk.models.shard import plan_shard
from distmk.tasks import TASK_KINDS


def test_phase_timeline_times_each_phase_from_the_previous_phases_last_end():
    spec = PRESETS["llama-3-8b"]
    table = compile_step(spec, plan_shard(spec, 1, 0), GraphConfig(batch=1, workers=132))
    run_us = {"qkv": 11.0, "attention": 4.0, "o_proj": 7.0, "gate_up": 50.0, "down": 26.0}
    kinds = [TASK_KINDS[int(t)].name for t in table.tasks[:, TYPE].tolist()]
    layers = table.tasks[:, LAYER].tolist()
    timings = torch.zeros(table.num_tasks, 4, dtype=torch.int64)
    end = 0
    for layer in range(spec.num_layers):
        for kind, run in run_us.items():
            tasks = [t for t in range(table.num_tasks) if layers[t] == layer and kinds[t] == kind]
            for i, t in enumerate(tasks):      # tasks start 1.0, 1.1 or 1.2 µs after the previous phase's end
                start = end + 1000 + (i % 3) * 100
                waited = end + 400 if i % 3 == 2 else end       # a third began waiting after that end
                timings[t] = torch.tensor([waited, start, start + int(run * 1000), 0])
            end = int(timings[tasks, 2].max())
    text = phase_timeline(table, timings)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:-1]}
    assert list(rows) == list(run_us)                               # in the order the phases start
    for kind, run in run_us.items():
        tasks, first, median, last, end_median, end_last, run_task, late, late_wait = (float(v) for v in rows[kind])
        assert (first, last, end_last, run_task, late_wait) == (1.0, 1.2, 1.2 + run, run, 0.8)
        assert late == sum(1 for i in range(int(tasks)) if i % 3 == 2)
    assert text.splitlines()[-1].split()[2] == f"{sum(run_us.values()) + 1.2 * len(run_us):.2f}"


def test_push_to_consume_pairs_each_tiles_push_with_its_reduction():
    """At tp=2 every row-parallel tile (which pushes its partial sum) and the allreduce of its rows pair up: a
    reduction that starts 3 µs after its tile ends, 5 µs for the last layer's MLP, gives a median of 3 and a largest
    of 5."""
    from distmk.graph.table import A0, A2
    from distmk.kernels.trace import push_to_consume_ns
    spec = PRESETS["tiny-llama"]
    table = compile_step(spec, plan_shard(spec, 2, 0), GraphConfig(batch=1, workers=8))
    kinds = [TASK_KINDS[int(t)].name for t in table.tasks[:, TYPE].tolist()]
    timings = torch.zeros(table.num_tasks, 4, dtype=torch.int64)
    last_mlp = 2 * spec.num_layers - 1
    for t, kind in enumerate(kinds):
        layer, row0 = int(table.tasks[t, LAYER]), int(table.tasks[t, A0])
        if kind in ("o_proj", "down"):
            timings[t, 2] = ((2 * layer + (kind == "down")) * 10_000 + row0) * 100
        elif kind == "allreduce":
            output = int(table.tasks[t, A2])
            timings[t, 1] = (output * 10_000 + row0) * 100 + (5000 if output == last_mlp else 3000)
    latency = push_to_consume_ns(table, timings)
    assert latency["tiles"] == kinds.count("allreduce") == kinds.count("o_proj") + kinds.count("down")
    assert latency["median"] == 3000 and latency["max"] == 5000
    assert push_to_consume_ns(compile_step(spec, plan_shard(spec, 1, 0), GraphConfig(batch=1, workers=8)),
                              timings) is None
