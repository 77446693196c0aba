"""The task graph and its schedule: structure, invariants, deadlock freedom for any W, and that results
do not depend on the number of workers or the order they run tasks in."""
import collections

import pytest
import torch

from distmk.errors import GraphError
from distmk.graph import GraphConfig, compile_step
from distmk.graph.lowering import GraphBuilder, compile_graph, hidden_tiles, row_parallel_phase
from distmk.graph.scheduler import check_deadlock_free
from distmk.graph.table import A0, A1, A2, LAYER, SIGNAL, TYPE, WAIT
from distmk.models.presets import PRESETS
from distmk.models.shard import plan_shard
from distmk.comm.cpu import run_simulated_ranks
from distmk.runtime.engine import Engine
from distmk.tasks import TASK_KINDS, TYPE_ID
from distmk.tasks.base import PUSH_PARTIAL, WRITE_PARTIAL
from conftest import PROMPT, SMALL


def table_for(name="tiny-qwen3", tp=2, **cfg):
    spec = PRESETS[name]
    table = compile_step(spec, plan_shard(spec, tp, 0), GraphConfig(**{**SMALL.__dict__, **cfg}))
    return table


def signal_weight(table, t) -> int:
    """Signals task t adds to its event: one, or one per rank for an exchange (every rank pushes)."""
    return table.tp if TASK_KINDS[int(table.tasks[t, TYPE])].signals_all_ranks else 1


def simulate(table):
    """Run the queues without computing anything; return the order tasks ran in (the executor's rule).
    Every rank runs the same table, so an exchange's pushes from all ranks arrive with the local one."""
    need, counters = table.event_need.tolist(), collections.Counter()
    queues = [table.worker_queue(w) for w in range(table.num_workers)]
    heads, order = [0] * len(queues), []
    while len(order) < table.num_tasks:
        moved = False
        for w, q in enumerate(queues):
            while heads[w] < len(q):
                t = q[heads[w]]
                e = int(table.tasks[t, WAIT])
                if e >= 0 and counters[e] < need[e]:
                    break
                order.append(t)
                counters[int(table.tasks[t, SIGNAL])] += signal_weight(table, t)
                heads[w] += 1
                moved = True
        assert moved, "deadlock"
    return order


@pytest.mark.parametrize("workers", [1, 2, 3, 7, 16, 64, 131, 132])
def test_every_task_once_and_dependencies_before_use(workers):
    table = table_for(workers=workers)
    assert sorted(table.queue.tolist()) == list(range(table.num_tasks))
    order = simulate(table)
    ran_at = {t: i for i, t in enumerate(order)}
    signalers = collections.defaultdict(list)
    for t in range(table.num_tasks):
        signalers[int(table.tasks[t, SIGNAL])].append(t)
    for t in range(table.num_tasks):
        e = int(table.tasks[t, WAIT])
        if e >= 0:
            assert sum(signal_weight(table, p) for p in signalers[e]) == table.event_need[e]
            assert all(ran_at[p] < ran_at[t] for p in signalers[e])


def test_no_deadlock_for_any_worker_count_up_to_132():
    spec = PRESETS["tiny-llama"]
    plan = plan_shard(spec, 2, 1)
    for workers in range(1, 133):
        table = compile_step(spec, plan, GraphConfig(batch=2, kv_splits=2, tile_rows=32, lm_tile_rows=64,
                                                     workers=workers))
        check_deadlock_free(table)
        simulate(table)


def test_deadlock_check_rejects_a_queue_that_waits_on_what_is_behind_it():
    table = table_for(workers=1)
    table.queue = table.queue.flip(0)             # the argmax first: it waits on everything else
    with pytest.raises(GraphError, match="can deadlock"):
        check_deadlock_free(table)
    table.queue = table.queue[1:]
    with pytest.raises(GraphError, match="exactly once"):
        check_deadlock_free(table)


def test_consumers_wait_only_on_the_tiles_they_read():
    table = table_for(tp=2)
    rows = table.tasks.tolist()
    by_signal = collections.defaultdict(list)
    for r in rows:
        by_signal[r[SIGNAL]].append(r)
    allreduces = [r for r in rows if r[TYPE] == TYPE_ID["allreduce"]]
    assert allreduces
    for r in allreduces:      # exactly the matmul tile of the same rows, which pushes them to every rank
        (push,) = by_signal[r[WAIT]]
        assert push[TYPE] in (TYPE_ID["o_proj"], TYPE_ID["down"]) and push[A0 + 2] == PUSH_PARTIAL
        assert (push[LAYER], push[A0], push[A1]) == (r[LAYER], r[A0], r[A1])
        assert r[A2] == 2 * r[LAYER] + (push[TYPE] == TYPE_ID["down"])
        assert table.event_need[r[WAIT]] == 2       # one push from each rank
    for r in rows:            # attention waits on its layer's QKV tiles (a tile may cross heads), all of them
        if r[TYPE] == TYPE_ID["attention"]:
            producers = by_signal[r[WAIT]]
            assert all(p[TYPE] == TYPE_ID["qkv"] and p[LAYER] == r[LAYER] for p in producers)
            assert len(producers) == sum(q[TYPE] == TYPE_ID["qkv"] and q[LAYER] == r[LAYER] for q in rows)


def test_qkv_tiles_are_row_ranges_of_about_one_per_worker():
    """QKV tiles cut this rank's rows of Wqkv (query, key and value heads) like the other row tiles, across heads:
    whole heads or slices of one left a quarter of the 132 workers idle at the 8B models (96 tiles)."""
    def tiles(name, tp, **cfg):
        table = table_for(name, tp, **cfg)
        qkv = table.tasks[(table.tasks[:, TYPE] == TYPE_ID["qkv"]) & (table.tasks[:, LAYER] == 0)]
        return [tuple(t) for t in qkv[:, [A0, A1]].tolist()]

    llama = tiles("llama-3-8b", 1, workers=132, tile_rows=0)
    assert len(llama) == 131 and llama[0] == (0, 47) and llama[-1] == (130 * 47, 6144 - 130 * 47)
    # tiny-qwen3 at tp=2: (4 query + 2 key + 2 value heads) x 32 rows, tiles of 24 rows ending inside heads
    assert sorted(tiles("tiny-qwen3", 2, tile_rows=24)) == [(r, min(24, 256 - r)) for r in range(0, 256, 24)]


def test_tp1_has_no_allreduce_and_tp2_has_one_per_row_parallel_tile():
    counts = {tp: collections.Counter(TASK_KINDS[t].name for t in table_for(tp=tp).tasks[:, TYPE].tolist())
              for tp in (1, 2)}
    assert counts[1]["allreduce"] == 0
    assert counts[2]["allreduce"] == counts[2]["o_proj"] + counts[2]["down"]


@pytest.mark.parametrize("exchange", [False, True])
def test_row_parallel_phases_with_and_without_their_all_reduce(exchange):
    """benchmarks/overlap.py's tables at tp=2: every layer's o_proj phase after the one before, each tile keeping its
    partial sum (WRITE_PARTIAL), or pushing it to every rank for the allreduce task of its rows (PUSH_PARTIAL);
    they run to the end."""
    spec = PRESETS["tiny-llama"]
    plan = plan_shard(spec, 2, 0)
    config = GraphConfig(**SMALL.__dict__).resolved(spec, plan)
    g, wait = GraphBuilder(), -1
    for layer in range(spec.num_layers):
        wait = row_parallel_phase(g, spec, plan, config, "o_proj", layer, wait, "attn", (-1,), exchange)
    table = compile_graph(g, spec, plan, config)
    kinds = collections.Counter(TASK_KINDS[t].name for t in table.tasks[:, TYPE].tolist())
    tiles = len(hidden_tiles(spec, config))
    assert kinds == {"o_proj": spec.num_layers * tiles, **({"allreduce": spec.num_layers * tiles} if exchange else {})}
    o_proj = table.tasks[table.tasks[:, TYPE] == TYPE_ID["o_proj"]]
    assert (o_proj[:, A0 + 2] == (PUSH_PARTIAL if exchange else WRITE_PARTIAL)).all()
    assert len(simulate(table)) == table.num_tasks


def test_table_is_compact_int_tensors():
    table = table_for()
    assert table.tasks.dtype == table.queue.dtype == table.queue_ptr.dtype == table.event_need.dtype == torch.int32
    assert table.tasks.shape[1] == 8 and table.queue_ptr[-1] == table.num_tasks


def generate_with(config, tp=2, name="tiny-qwen2"):
    return run_simulated_ranks(tp, lambda r, c: Engine(name, tp=tp, rank=r, comm=c, config=config)
                               .generate(PROMPT, 12, return_logits=True))


def test_results_do_not_depend_on_workers_or_their_order():
    base_tokens, base_logits = generate_with(SMALL)[0]
    for workers in (1, 2, 13, 132):
        tokens, logits = generate_with(GraphConfig(**{**SMALL.__dict__, "workers": workers}))[0]
        assert tokens == base_tokens
        assert torch.equal(logits, base_logits)            # bit-identical, not merely close


def test_executor_reports_a_deadlocked_table():
    engine = Engine("tiny-llama", config=SMALL)
    engine.executor.queues = [list(range(engine.table.num_tasks - 1, -1, -1))]   # argmax first
    with pytest.raises(GraphError, match=r"deadlock: worker 0 task \d+ \(argmax\) waits on event"):
        engine.generate([1, 2], 2)


def test_device_figures_fixed_off_a_gpu_and_looked_up_by_gpu_name(monkeypatch):
    """Off a GPU a graph gets an H200's figures, the defaults, so CPU-built tables match everywhere; on one
    the bandwidth is the first table entry found in the GPU's name ("H100 PCIe" before "H100")."""
    from distmk.graph import hardware
    from distmk.runtime.engine import device_fields
    assert (device_fields("reference", "cpu") == {"workers": 132, "hbm_bytes_per_s": 4.5e12}
            == {"workers": GraphConfig.workers, "hbm_bytes_per_s": GraphConfig.hbm_bytes_per_s})
    assert device_fields("triton", "cpu")["workers"] == 1             # Triton's interpreter: one at a time
    assert device_fields("triton", "cpu", workers=7)["workers"] == 7
    for name, bandwidth in (("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                            ("NVIDIA H200", 4.5e12), ("a GPU the table lacks", hardware.DEFAULT_HBM_BYTES_PER_S)):
        monkeypatch.setattr(hardware.torch.cuda, "get_device_name", lambda device, name=name: name)
        assert hardware.hbm_bytes_per_s("cuda") == bandwidth


def test_cost_model_reads_the_bandwidth():
    assert (table_for(hbm_bytes_per_s=1e12).schedule["makespan_s"]
            > table_for().schedule["makespan_s"])


def test_fused_attn_reduce_drops_the_phase_and_changes_no_result():
    """fused_attn_reduce=1: no attn_reduce tasks; every attention task signals the event o_proj waits on, and the
    split that ends its group last combines it, in the same fixed order (bit-identical logits, any worker count,
    tp=2, a group of query heads cut over two attention tasks)."""
    table = table_for("tiny-qwen3-moe", tp=2, fused_attn_reduce=1)
    kinds = table.tasks[:, TYPE]
    assert not (kinds == TYPE_ID["attn_reduce"]).any()
    attention = (kinds == TYPE_ID["attention"]).nonzero().flatten()
    o_proj = (kinds == TYPE_ID["o_proj"]).nonzero().flatten()
    for layer in range(PRESETS["tiny-qwen3-moe"].num_layers):
        signals = {int(table.tasks[t, SIGNAL]) for t in attention if int(table.tasks[t, LAYER]) == layer}
        waits = {int(table.tasks[t, WAIT]) for t in o_proj if int(table.tasks[t, LAYER]) == layer}
        assert len(signals) == 1 and signals == waits
        assert int(table.event_need[signals.pop()]) == sum(int(table.tasks[t, LAYER]) == layer for t in attention)
    base_tokens, base_logits = generate_with(SMALL, name="tiny-qwen3-moe")[0]
    for workers in (1, 13):
        config = GraphConfig(**{**SMALL.__dict__, "workers": workers, "fused_attn_reduce": 1})
        tokens, logits = generate_with(config, name="tiny-qwen3-moe")[0]
        assert tokens == base_tokens
        assert torch.equal(logits, base_logits)
    with pytest.raises(GraphError, match="fused_attn_reduce must be 0 or 1"):
        GraphConfig(fused_attn_reduce=2)
