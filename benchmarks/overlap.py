"""How much of the all-reduce the ring megakernel hides behind the weight stream: the o_proj tiles of every layer
of MODEL (the row-parallel GEMV, this rank's [H, K / tp] slice of Wo, streamed from HBM), one layer after the other,
each tile pushing its partial sum to every rank, and the allreduce tasks of its rows, in the same persistent kernel,
as the decode step runs them (graph/lowering.py row_parallel_phase); against the same tiles without the
all-reduce. Under a launcher, also cuBLAS's GEMV per layer, then with NCCL's all-reduce after each, captured in a
CUDA graph. One JSON object, per layer:

    torchrun --standalone --nproc-per-node 2 benchmarks/overlap.py --out benchmarks/results/overlap.json
    python benchmarks/overlap.py --virtual-tp 2 --out overlap_vtp2.json     (N ranks sharing this one GPU)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import graph_us  # noqa: E402
from decode import git_commit  # noqa: E402

VARIANTS = (("gemv_us", False), ("fused_us", True))      # (result key, all-reduce after each tile)


def o_proj_layers(spec, plan, config, exchange: bool):
    """The table of every layer's o_proj phase, each waiting for the one before (with `exchange`, for its
    all-reduce)."""
    from distmk.graph.lowering import GraphBuilder, compile_graph, row_parallel_phase
    g, wait = GraphBuilder(), -1
    for layer in range(spec.num_layers):
        wait = row_parallel_phase(g, spec, plan, config, "o_proj", layer, wait, "attn", (-1,), exchange)
    return compile_graph(g, spec, plan, config)


def rank_overlap(args, comm) -> dict:
    """This rank's µs per layer of each variant, timed as graph replays, every rank starting together."""
    from distmk.graph import GraphConfig
    from distmk.kernels.autotune import launch_times
    from distmk.kernels.executor import TritonExecutor
    from distmk.models.shard import load_shard, plan_shard
    from distmk.models.weights import open_model
    from distmk.runtime.engine import device_fields
    from distmk.runtime.kv_cache import KVCache
    device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    spec, source, _ = open_model(args.model, seed=0, device=device)
    plan = plan_shard(spec, comm.world, comm.rank)
    weights = load_shard(spec, source, plan, dtype=dtype, device=device)
    config = GraphConfig(batch=args.batch, tile_rows=args.tile_rows,
                         **device_fields("triton", device, None, getattr(comm, "ranks_on_device", 1)))
    config = config.resolved(spec, plan)
    kv = KVCache(spec.num_layers, args.batch, 1, 16, plan.num_kv_heads, spec.head_dim, dtype, device)
    rows = np.zeros((args.batch, 3), dtype=np.int64)        # token 0 at position 0 (o_proj reads neither)
    result = {"layers": spec.num_layers, "hidden": spec.hidden_size, "k_per_rank": plan.num_heads * spec.head_dim,
              "workers": config.workers, "tile_rows": config.tile_rows}
    for key, exchange in VARIANTS:
        executor = TritonExecutor(o_proj_layers(spec, plan, config, exchange), spec, weights, kv, comm, dtype,
                                  kernel="ring", timeout_s=args.timeout)
        executor.buf["attn"].normal_()
        executor.set_inputs(rows)
        executor.launch()               # compiled, captured
        executor.check()
        comm.barrier()
        result[key] = statistics.median(launch_times(executor, args.iters, warmup=10)) * 1e3 / spec.num_layers
        del executor
        torch.cuda.synchronize()
        comm.barrier()
    result["fused_over_gemv"] = result["fused_us"] / result["gemv_us"]
    return result


def nccl_baselines(args, shape: dict) -> dict:
    """cuBLAS's GEMV of the rank's slice per layer, then with NCCL's all-reduce after each: µs per layer (`shape`:
    rank_overlap's result)."""
    import torch.distributed as dist
    layers, H, K = shape["layers"], shape["hidden"], shape["k_per_rank"]
    w = (torch.randn(layers, H, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
    x = torch.randn(args.batch, K, device="cuda").to(torch.bfloat16)
    out = torch.empty(args.batch, H, device="cuda", dtype=torch.bfloat16)
    dist.all_reduce(out)                  # NCCL's communicator exists before any capture

    def run(all_reduce: bool):
        for layer in range(layers):
            torch.matmul(x, w[layer].t(), out=out)
            if all_reduce:
                dist.all_reduce(out)

    baselines = {name: graph_us(lambda: run(all_reduce), 30) / layers
                 for name, all_reduce in (("cublas_us", False), ("cublas_nccl_us", True))}
    return {**baselines, "cublas_nccl_over_cublas": baselines["cublas_nccl_us"] / baselines["cublas_us"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="a preset or checkpoint: its o_proj shapes and layers")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tile-rows", type=int, default=0, help="rows of an o_proj tile (0: the decode step's)")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds a task may wait for its event")
    p.add_argument("--virtual-tp", type=int, default=1, metavar="N",
                   help="N ranks in this process on this one GPU (a measurement mode, not a deployment)")
    p.add_argument("--out", default="benchmarks/results/overlap.json")
    args = p.parse_args()
    if args.virtual_tp > 1:
        from distmk.comm.cpu import VIRTUAL_RANKS_ENV, run_simulated_ranks
        os.environ.update(VIRTUAL_RANKS_ENV)        # before CUDA starts
        per_rank = run_simulated_ranks(args.virtual_tp, lambda rank, comm: rank_overlap(args, comm), timeout=1800)
        world, launcher = args.virtual_tp, "virtual"
        baselines = {"cublas_us": None, "cublas_nccl_us": None}
    else:
        import torch.distributed as dist
        from exchange_rounds import start_ranks
        launch, comm = start_ranks(p)
        try:
            mine = rank_overlap(args, comm)
            baselines = nccl_baselines(args, mine)
            per_rank = [None] * launch.world
            dist.all_gather_object(per_rank, mine)
        finally:
            comm.close()
            dist.destroy_process_group()
        if launch.rank != 0:
            return 0
        world, launcher = launch.world, launch.launcher
    result = {"model": args.model, "world": world, "launcher": launcher, "batch": args.batch, **per_rank[0],
              "rank_fused_us": [r["fused_us"] for r in per_rank], "kernel": "ring", **baselines,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "distmk_commit": git_commit(), "command": shlex.join(["python", *sys.argv])}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
