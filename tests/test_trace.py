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
