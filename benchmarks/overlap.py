"""How much of the all-reduce the megakernel hides behind matmul tiles: an o_proj-sized GEMV (row-parallel,
this rank's [H, K] slice per layer, weights of 32 layers streamed from HBM) with its all-reduce fused in
one persistent kernel, against the GEMV alone in the same kernel, and against cuBLAS GEMV then NCCL
all-reduce captured in a CUDA graph. One JSON object:

    torchrun --standalone --nproc-per-node 2 benchmarks/overlap.py --out benchmarks/results/overlap.json

Each configuration runs rounds (one layer each) in one launch; tiles_per_program > 1 lets a program
start tile i+1's GEMV while tile i's exchange is in flight, and the pipelined variant reduces a round
only after the next round's GEMV (benchmarks/exchange_rounds.py). fused_us in the result is the best
fused variant.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import graph_us  # noqa: E402
from exchange_rounds import ExchangeRounds, start_ranks  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096, help="H: output rows of o_proj (llama-3-8b: 4096)")
    p.add_argument("--k", type=int, default=4096, help="o_proj input width before sharding (heads x head_dim)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=320)
    p.add_argument("--tiles-per-program", default=[1], type=lambda v: [int(x) for x in v.split(",")],
                   help="comma-separated, e.g. 1,2,4; each value compiles three kernels (about half a minute each)")
    p.add_argument("--out", default="benchmarks/results/overlap.json")
    args = p.parse_args()
    launch, comm = start_ranks(p)
    H, K, n = args.hidden, args.k // launch.world, args.batch
    tiles = H // 32
    configs, graphs = [], {}

    def say(message):
        if launch.rank == 0:
            print(f"[overlap] {message}", file=sys.stderr, flush=True)

    try:
        # the baselines first: cuBLAS GEMV per layer, then with NCCL's all-reduce after each, in one CUDA graph
        w = (torch.randn(args.layers, H, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        x = torch.randn(n, K, device="cuda").to(torch.bfloat16)
        out = torch.empty(n, H, device="cuda", dtype=torch.bfloat16)
        dist.all_reduce(out)                  # NCCL's communicator exists before any capture

        def layers(all_reduce: bool):
            for layer in range(args.layers):
                torch.matmul(x, w[layer].t(), out=out)
                if all_reduce:
                    dist.all_reduce(out)

        for name, all_reduce in (("cublas_us", False), ("cublas_nccl_us", True)):
            say(f"{name} ...")
            graphs[name] = graph_us(lambda: layers(all_reduce), 30) / args.layers
        del w
        for per_program in args.tiles_per_program:
            row = {"tiles_per_program": per_program, "programs": tiles // per_program}
            for name, exchange, pipelined in (("gemv_us", False, False), ("fused_us", True, False),
                                              ("fused_pipelined_us", True, True)):
                say(f"{per_program} tiles per program, {name} ...")
                ex = ExchangeRounds(comm, n, H, tiles, per_program, "pointer", K=K, layers=args.layers, gemv=True,
                                    exchange=exchange, pipelined=pipelined)
                row[name] = ex.us_per_round(args.rounds)
                del ex
            configs.append(row)
            say(json.dumps(row))
        # written before the clean-up below, which waits on every rank
        best_gemv = min(c["gemv_us"] for c in configs)
        best_fused = min(min(c["fused_us"], c["fused_pipelined_us"]) for c in configs)
        result = {"world": launch.world, "hidden": H, "k_per_rank": K, "batch": n, "layers": args.layers,
                  "configs": configs, "gemv_us": best_gemv, "fused_us": best_fused,
                  "fused_over_gemv": best_fused / best_gemv, **graphs,
                  "cublas_nccl_over_cublas": graphs["cublas_nccl_us"] / graphs["cublas_us"],
                  "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["torchrun", f"--nproc-per-node {launch.world}", *sys.argv])}
        if launch.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            print(json.dumps(result))
    finally:
        comm.close()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
