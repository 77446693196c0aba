"""The megakernel's Triton code run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), checked
against the reference executor, so CI catches kernel regressions without a GPU. One worker: the
interpreter runs programs one after another, so only a single queue can make progress."""
import json
import os
import subprocess
import sys

import pytest

import threaded_interpreter
from conftest import REPO, TINY, TINY_MOE
from test_gpu import run_watchdog_script

INTERPRETED = {**os.environ, "TRITON_INTERPRET": "1"}

SCRIPT = """
import json, sys
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine
name, router_partials, quantize = sys.argv[1], int(sys.argv[2]), (sys.argv[3:] or [None])[0]
# matmul tiles of 24 rows, not a multiple of the kernels' row blocks (QKV tiles that end inside a head: attention
# finishes the heads); the one-row decode steps run a table of their own (BATCH 1: the expert tiles' path where
# every slot leads; the tensor-parallel test below runs one-row steps on a four-row table); router_partials 0 gives
# the four-row table router tiles and the one-row table the o_proj tiles' shares, 1 shares to both (and the
# attention groups combined by their last split, the route by the o_proj tile that adds the last share:
# fused_attn_reduce, fused_route)
config = GraphConfig(batch=4, kv_splits=3, tile_rows=24, lm_tile_rows=48, workers=1,
                     router_partials=router_partials, fused_attn_reduce=router_partials, fused_route=router_partials)
# quantize fp8: the triton backend's tiles read the e4m3 products (stream_e4m3), the reference their dequantized copies
engines = [Engine(name, backend=b, config=config, step_batches=(1,), quantize=quantize,
                  kernel_options={"stream_e4m3": 1} if b == "triton" and quantize else None)
           for b in ("reference", "triton")]
assert bool(engines[1].weights.fp8) == bool(quantize)
if quantize:    # as a ring kernel on these weights would leave them: the tl kernel's steps take their own order back
    from distmk.device.ring import part_columns
    engines[1].weights.order_fp8(part_columns())
runs = [e.generate([1, 2, 3, 4, 5, 6, 7], 3, return_logits=True) for e in engines]
(ref_tokens, ref_logits), (tokens, logits) = runs
err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
# every sparse layer's choices of the last step (one row, on the one-row table), as the route tasks kept them
history = [(e.last_executor.buf if hasattr(e.last_executor, "buf") else e.last_executor.ctx.buf)["route_history"]
           [:, :1].tolist() for e in engines]
print(json.dumps({"model": name, "equal": tokens == ref_tokens, "rel_err": err, "history": history,
                  "e4m3": sorted(engines[1].weights.fp8)}))
"""


# the models whose FP8 twins run (--quantize fp8, the triton backend's tiles reading the e4m3 products) and the
# products that stay e4m3: tiny-llama's wqkv stays dequantized (its 64-row k slice holds no whole block)
FP8_TWINS = {"tiny-llama": {"wo", "w_gate", "w_up", "w_down"}, "tiny-qwen3": {"wqkv", "wo", "w_gate", "w_up", "w_down"},
             "tiny-qwen3-moe": {"wo", "expert_gate", "expert_up", "expert_down"}}


@pytest.mark.parametrize("models", [TINY, TINY_MOE], ids=["dense", "moe"])
def test_interpreted_megakernel_matches_reference(models):
    """Every task type's tl device function against its reference semantics; for the mixture-of-experts presets
    the router, the route task's distinct experts, the expert tiles that cut their rows at run time (crossing from
    one expert into the next) and the combine (prompt steps of 4 and 3 rows, then one-row steps on a one-row
    table); the gate's logits from router tiles and from the o_proj tiles' shares (the second model's prompt
    steps too: router_partials 1, which also runs it with fused_attn_reduce and fused_route). The FP8_TWINS run
    as --quantize fp8 with kernel option stream_e4m3: the tl tiles load the e4m3 products (their stacked values
    and block scales, what the ring streams too) and dequantize them as they load them, with the tokens and
    logits of the reference on the dequantized weights, after the columns were put in the ring's order under the
    tl kernel (an executor of each kernel on one model's weights); the other models keep every product in bf16."""
    # a process per model, all at once: the interpreter is single-threaded and CI has two cores
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, name, str(int(i == 1)),
                               *(["fp8"] if name in FP8_TWINS else [])], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=INTERPRETED)
             for i, name in enumerate(models)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err
            results += [json.loads(line) for line in out.splitlines()]
    finally:
        for proc in procs:      # a failure or a timeout leaves no interpreter running
            proc.kill()
            proc.wait()
    assert [r["model"] for r in results] == models
    for r in results:
        assert r["equal"] and r["rel_err"] < 1e-4, r
        assert set(r["e4m3"]) == FP8_TWINS.get(r["model"], set()), r
        ref_history, history = r["history"]
        assert history == ref_history, r
        if models == TINY_MOE:       # the route tasks' choices of each sparse layer (a dense model keeps none)
            assert all(len(set(layer[0])) == len(layer[0]) > 1 for layer in history), r


TOY_TASK_SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import torch
from distmk.tasks import register
from toy_task import Double
register(Double())
from distmk.graph import GraphConfig
from distmk.graph.lowering import GraphBuilder, StepShape
from distmk.graph.scheduler import schedule
from distmk.kernels.executor import TritonExecutor
from distmk.reference.executor import ReferenceExecutor
from distmk.runtime.engine import Engine
from distmk.tasks import TASK_KINDS
engine = Engine(sys.argv[1], backend="reference", config=GraphConfig(batch=2, workers=1))
config = engine.config
g = GraphBuilder()                        # embed both rows, then double each
embedded, doubled = g.event("x.embed", 2), g.event("x.doubled", 2)
for row in range(2):
    g.task("embed", 0, (row,), signal=embedded)
for row in range(2):
    g.task("double", 0, (row,), wait=embedded, signal=doubled)
tasks, need = g.tensors(1)
shape = StepShape(engine.spec, engine.plan, 2, config.kv_splits, config.context)
cost = torch.tensor([TASK_KINDS[t[0]].cost(shape, t[1], tuple(t[2:6])) for t in g.rows])
table = schedule(tasks, need, cost, g.event_names, config)
tokens, positions = torch.tensor([3, 5]), torch.zeros(2, dtype=torch.int64)
block_table = torch.zeros(2, engine.kv.blocks_per_seq, dtype=torch.int64)
out = {}
for name, executor in (("reference", ReferenceExecutor), ("triton", TritonExecutor)):
    ex = executor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype)
    out[name] = ex.step(tokens, positions, block_table)["x"][:2].clone()
expected = 2 * engine.weights.embed[tokens].float()
print(json.dumps({name: torch.equal(x, expected) for name, x in out.items()}))
"""


def test_interpreted_toy_task_type():
    """A task type registered from outside the package (tests/toy_task.py: its file and one register line) runs
    in both the reference executor and the generated megakernel, with no other file touched."""
    proc = subprocess.run([sys.executable, "-c", TOY_TASK_SCRIPT, TINY[0]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=INTERPRETED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"reference": True, "triton": True}


DECODE_SCRIPT = """
import json
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine
engine = Engine("tiny-llama", backend="triton", config=GraphConfig(batch=8, workers=1), max_seqs=2)
blocks = [engine.kv.allocate([], 12), engine.kv.allocate([], 12)]
engine.step([1, 2, 3, 4, 5], range(5), [blocks[0]] * 5)
engine.step([9, 8, 7], range(3), [blocks[1]] * 3)
tokens, positions, single = [11, 12], [5, 3], []
for _ in range(4):                               # one step at a time, each waited for
    buf = engine.step(tokens, positions, blocks)
    tokens, positions = buf["next_token"][:2].tolist(), [p + 1 for p in positions]
    single.append(tokens)
# four steps in one go from the same prompt state (they rewrite the same KV entries with the same values)
print(json.dumps({"single": single, "back_to_back": engine.decode([11, 12], [5, 3], blocks, 4)}))
"""


def test_interpreted_steps_back_to_back_match_single_steps():
    """Engine.decode feeds each step's tokens to the next on the device and waits once, after the last: the
    megakernel's tokens equal those of steps waited for one by one."""
    proc = subprocess.run([sys.executable, "-c", DECODE_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=INTERPRETED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert len(result["single"]) == 4 and result["back_to_back"] == result["single"]


TENSOR_PARALLEL_SCRIPT = """
import json, sys
sys.path.insert(0, "tests")
import threaded_interpreter
threaded_interpreter.keep_patched()
import torch
from distmk.graph import GraphConfig
from distmk.comm.cpu import run_simulated_ranks
from distmk.runtime.engine import Engine
config = GraphConfig(batch=4, kv_splits=2, tile_rows=24, lm_tile_rows=48, workers=1)   # all-reduce tiles of 24 rows
name, tp = sys.argv[1], int(sys.argv[2])
runs = {b: run_simulated_ranks(tp, lambda r, c: Engine(name, tp=tp, rank=r, comm=c, config=config, backend=b)
                               .generate([1, 2, 3, 4, 5, 6, 7], 3, return_logits=True), timeout=600)
        for b in ("reference", "triton")}
ref, tri = runs["reference"], runs["triton"]
print(json.dumps({"equal": [t[0] for t in tri] == [r[0] for r in ref],
                  "ranks_identical": all(torch.equal(t[1], tri[0][1]) for t in tri),
                  "rel_err": max(((t[1] - r[1]).abs().max() / r[1].abs().max()).item() for t, r in zip(tri, ref))}))
"""


@pytest.mark.parametrize("name, tp", [("tiny-qwen2", 2), ("tiny-llama", 4), ("tiny-mixtral", 2)])
def test_interpreted_tensor_parallel_megakernel(name, tp):
    """Exchanges through peers' buffers and events signalled on every rank, against the reference."""
    if not threaded_interpreter.SUPPORTED:
        pytest.skip("this Triton's interpreter has no _patch_lang to keep patched across threads")
    proc = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL_SCRIPT, name, str(tp)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=INTERPRETED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["equal"] and result["ranks_identical"] and result["rel_err"] < 1e-4, result


def test_interpreted_watchdog_fires():
    run_watchdog_script("cpu", 1, env=INTERPRETED)


EXCHANGE_ROUNDS_SCRIPT = """
import json, sys
sys.path[:0] = ["tests", "benchmarks"]
import threaded_interpreter
threaded_interpreter.keep_patched()
import torch
from exchange_rounds import ExchangeRounds
from distmk.comm.cpu import run_simulated_ranks
rounds = 7

def rank(r, comm):
    torch.manual_seed(r)
    ex = ExchangeRounds(comm, 2, 128, 4, "pointer", device="cpu")
    ex.launch(3)                 # two launches: rounds are counted across them
    ex.launch(rounds - 3)
    return ex.partial[:2], ex.x[:2].clone(), int(ex.error)

out = run_simulated_ranks(2, rank, timeout=600)
expected = rounds * sum(partial for partial, _, _ in out)
print(json.dumps({"errors": [o[2] for o in out], "identical": torch.equal(out[0][1], out[1][1]),
                  "rel_err": ((out[0][1] - expected).abs().max() / expected.abs().max()).item()}))
"""


def test_interpreted_exchange_rounds_benchmark_kernel():
    """benchmarks/exchange_rounds.py (allreduce.py's kernel) on two simulated ranks: after rounds of all-reduce over
    two launches, every rank holds the same sum of all ranks' partials, rounds times, and no wait gave up."""
    if not threaded_interpreter.SUPPORTED:
        pytest.skip("this Triton's interpreter has no _patch_lang to keep patched across threads")
    proc = subprocess.run([sys.executable, "-c", EXCHANGE_ROUNDS_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=INTERPRETED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["errors"] == [0, 0] and r["identical"] and r["rel_err"] < 1e-5, r
