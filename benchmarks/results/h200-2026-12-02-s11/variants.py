"""Ring megakernel variants on one engine's weights: median step ms (graph replays), and traces."""
import json, statistics, sys, time, torch
import sys; sys.path.insert(0, "benchmarks"); from harness import decode_step
from distmk.kernels.autotune import launch_times
from distmk.kernels.executor import TritonExecutor
from distmk.kernels import trace
model, batch = sys.argv[1], int(sys.argv[2])
variants = json.loads(sys.argv[3])
engine, step = decode_step(model, batch, 512, kernel="tl")
ref = engine.executor.buf["logits"][:batch].clone()
for vi, v in enumerate(variants):
    v = dict(v)
    t0 = time.time()
    table = engine.table
    if "graph" in v:            # GraphConfig overrides: a table of their own on the same weights
        import dataclasses
        from distmk.graph.lowering import compile_step
        table = compile_step(engine.spec, engine.plan, dataclasses.replace(engine.config, **v.pop("graph")))
    try:
        ex = TritonExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype, **v)
        for name in ("tokens", "positions", "block_table", "rows"):
            getattr(ex, name).copy_(getattr(engine.executor, name))
        for _ in range(3):
            ex.launch()
        ex.check()
    except Exception as e:
        print(f"{model} b{batch} {v}: FAILED {type(e).__name__}: {str(e)[-300:]}", flush=True)
        continue
    err = ((ex.buf["logits"][:batch] - ref).norm() / ref.norm()).item()
    if v.get("trace"):
        print(trace.breakdown(table, ex.timings()))
        import os
        torch.save({"tasks": table.tasks, "timings": ex.timings()}, os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("TAG", "") + f"{model}_b{batch}_{v.get('kernel')}_{vi}.pt"))
        print(f"{model} b{batch} {v} traced, logits rel err {err:.2e}", flush=True)
    else:
        ms = statistics.median(launch_times(ex, 50, warmup=5))
        print(f"{model} b{batch} {v}: {ms:.3f} ms, logits rel err vs tl {err:.2e} ({time.time()-t0:.0f} s)", flush=True)
    del ex; torch.cuda.empty_cache()
