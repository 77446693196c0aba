"""Time the megakernel's decode step and show where the time goes:
    python benchmarks/profile_step.py --model llama-3-8b --batch 1 --context 512
    torchrun --standalone --nproc-per-node 2 benchmarks/profile_step.py --model llama-3-8b
Prints the median step time (CUDA-graph replays), the per-task-type breakdown (running and waiting time per type)
and the per-phase timeline of one traced step (under torchrun, rank 0's)."""
import argparse
import json
import os

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--options", default="{}", help='kernel options as JSON, e.g. {"block_n": 64}')
    p.add_argument("--graph", default="{}", help='task-graph options as JSON, e.g. {"tile_rows": 64}')
    args = p.parse_args()
    from distmk.dist import detect_launch, init_process_group
    from harness import distmk_step_ms
    launch = detect_launch()
    torch.cuda.set_device(launch.local_rank)
    if launch.world > 1:
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        init_process_group(launch, "nccl")
    options = json.loads(args.options)
    result = distmk_step_ms(args.model, args.batch, args.context, args.iters, breakdown=True,
                            graph=json.loads(args.graph), **options)
    if launch.rank == 0:
        text = result.pop("breakdown")
        print(json.dumps({"model": args.model, "batch": args.batch, "context": args.context, **result}))
        print(text, flush=True)


if __name__ == "__main__":
    main()
