"""Kernel-option and task-graph variants of one decode step, timed in one process on one engine's weights:

    python benchmarks/variants.py --model llama-3-8b --batch 1 \\
        --variants '[{"kernel": "ring"}, {"kernel": "ring", "ring_slots": 4}, {"kernel": "ring", "trace": true}]'

With --quantize fp8 the engine's weights are the model's FP8 twin with its products held in e4m3 alone (the engine is
built with stream_e4m3), and every variant's executor streams them in e4m3.

A variant is KernelOptions fields (kernels/options.py), plus "graph": GraphConfig fields (a table of its own over
the same weights and KV cache) and "trace": true (one traced step: the per-type breakdown and the phase timeline,
kernels/trace.py). Each untraced variant prints two medians of --iters graph replays (their spread is the noise
to judge a difference by) and the relative error of its logits against the engine's own step (--engine-kernel).
This is where the megakernel is iterated on: a variant takes seconds, a decode.py run with its baselines minutes.
To compare code, run it once per tree (PYTHONPATH) in one device call: machines differ by a few percent.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

from harness import decode_step
from distmk.cli import add_quantize_arg
from distmk.flags import COUNT


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--batch", type=COUNT, default=1, help="rows per step")
    p.add_argument("--context", type=COUNT, default=512, help="positions each row attends to")
    p.add_argument("--variants", required=True, help="a JSON list of variants (see above)")
    p.add_argument("--engine-kernel", default="tl", choices=("tl", "ring"),
                   help="the kernel of the engine's own step, the logits' reference")
    p.add_argument("--iters", type=COUNT, default=50, help="graph replays per median")
    p.add_argument("--trace-dir", help="also save each traced step's tasks and timings (torch.save) here")
    add_quantize_arg(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("variants.py times GPU kernels: no CUDA GPU is visible", file=sys.stderr)
        return 2
    from distmk.graph.lowering import compile_step
    from distmk.kernels import trace
    from distmk.kernels.autotune import launch_times
    from distmk.kernels.executor import TritonExecutor
    variants = json.loads(args.variants)
    engine, _ = decode_step(args.model, args.batch, args.context, kernel=args.engine_kernel, quantize=args.quantize,
                            **({"stream_e4m3": 1} if args.quantize else {}))
    reference = engine.executor.buf["logits"][:args.batch].clone()
    for index, variant in enumerate(variants):
        options, t0 = dict(variant), time.perf_counter()
        graph, table = options.pop("graph", None), engine.table
        if graph:
            table = compile_step(engine.spec, engine.plan, dataclasses.replace(engine.config, **graph))
        label = f"{args.model} b{args.batch} {json.dumps(variant)}"
        try:
            ex = TritonExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype, **options)
            for name in ("tokens", "positions", "block_table", "rows"):
                getattr(ex, name).copy_(getattr(engine.executor, name))
            for _ in range(3):
                ex.launch()
            ex.check()
        except Exception as e:  # noqa: BLE001 - a variant that fails to build or run is reported, the rest go on
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[-400:]}", flush=True)
            continue
        logits = ex.buf["logits"][:args.batch]
        error = ((logits - reference).norm() / reference.norm()).item()
        if options.get("trace"):
            timings = ex.timings()
            print(trace.breakdown(table, timings), trace.phase_timeline(table, timings), sep="\n")
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                torch.save({"tasks": table.tasks, "timings": timings},
                           os.path.join(args.trace_dir, f"{args.model}_b{args.batch}_{index}.pt"))
            print(f"{label}: traced, logits rel err {error:.2e}", flush=True)
        else:
            medians = [statistics.median(launch_times(ex, args.iters, warmup=5)) for _ in range(2)]
            print(f"{label}: {medians[0]:.3f} / {medians[1]:.3f} ms, logits rel err {error:.2e} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del ex
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
