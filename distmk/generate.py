"""python -m distmk.generate: generate from a prompt, alone (tp=1) or under torchrun / mpirun (tp=N).

With --json, rank 0 prints one line: {"tokens": [...], "text": ..., ...}; other ranks print nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from distmk.dist import detect_launch, init_process_group
from distmk.errors import DistmkError
from distmk.graph.lowering import GraphConfig
from distmk.runtime.engine import DTYPES, Engine, default_workers
from distmk.runtime.sampling import SamplingParams
from distmk.runtime.tokenizer import load_tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m distmk.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory or preset name")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenizer of the checkpoint; bytes for presets)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--backend", choices=["reference", "triton"], default="reference")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and preset weight seed)")
    p.add_argument("--batch", type=int, default=16, help="rows per step (prefill chunk)")
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--kv-splits", type=int, default=0, help="0 = one attention split per worker, at most 16")
    p.add_argument("--tile-rows", type=int, default=0, help="0 = about one tile per worker")
    p.add_argument("--workers", type=int, default=None,
                   help="worker queues (default: the GPU's SMs for the triton backend, else 132)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--trace", metavar="OUT.json",
                   help="triton backend: write a Chrome/Perfetto trace of the last step and print the "
                        "time per task type")
    p.add_argument("--timeout", type=float, default=5.0, help="triton backend: seconds a task may wait")
    p.add_argument("--transport", choices=("auto", "pointer", "nvshmem"), default="auto",
                   help="triton backend at tp>1: how all-reduce tiles reach peers (auto: peer pointers when every "
                        "peer is reachable by one, else NVSHMEM put-with-signal)")
    p.add_argument("--no-autotune", action="store_true",
                   help="triton backend: use the cached or default kernel options, measure nothing")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line")
    return p.parse_args(argv)


def open_comm(args, launch):
    """None for one rank; torch.distributed for the reference backend; NVSHMEM for the megakernel."""
    if launch.world == 1:
        return None
    init_process_group(launch, "gloo" if args.device == "cpu" else "nccl")
    if args.backend == "triton":
        from distmk.comm.nvshmem import NvshmemComm
        return NvshmemComm(launch)
    from distmk.reference.comm import TorchDist
    return TorchDist()


def run(args) -> dict:
    launch = detect_launch()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise DistmkError("--device cuda: no CUDA device is visible")
    if args.device == "cuda":
        torch.cuda.set_device(launch.local_rank)
    comm = open_comm(args, launch)
    try:
        return run_with(args, launch, comm)
    finally:
        if hasattr(comm, "close"):    # NVSHMEM: free symmetric memory and finalize, or the process hangs at exit
            comm.close()


def run_with(args, launch, comm) -> dict:
    device = args.device if args.device == "cpu" else f"cuda:{launch.local_rank}"
    dtype = DTYPES[args.dtype or ("float32" if args.device == "cpu" else "bfloat16")]
    config = GraphConfig(batch=args.batch, kv_splits=args.kv_splits, tile_rows=args.tile_rows,
                         workers=args.workers or default_workers(args.backend, device))
    t0 = time.perf_counter()
    if args.trace and args.backend != "triton":
        raise DistmkError("--trace needs --backend triton")
    kernel_options = ({"trace": bool(args.trace), "timeout_s": args.timeout, "transport": args.transport}
                      if args.backend == "triton" else None)
    engine = Engine(args.model, tp=launch.world, rank=launch.rank, comm=comm, dtype=dtype, device=device,
                    backend=args.backend, config=config, max_context=args.max_context, seed=args.seed,
                    progress=launch.rank == 0 and not args.json, kernel_options=kernel_options,
                    autotune=not args.no_autotune, max_seqs=1)
    tokenizer = load_tokenizer(engine.tokenizer_dir, engine.spec.vocab_size)
    if args.prompt is not None:
        prompt = tokenizer.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise DistmkError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if args.max_new_tokens < 1:
        raise DistmkError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    t1 = time.perf_counter()
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    tokens = engine.generate(prompt, args.max_new_tokens, params, stop_on_eos=not args.ignore_eos)
    t2 = time.perf_counter()
    if args.trace:
        from distmk.kernels.trace import breakdown, write_trace
        timings = engine.executor.timings()
        write_trace(args.trace, engine.table, timings, launch.rank)
        print(breakdown(engine.table, timings), file=sys.stderr)
    return {"tokens": tokens, "text": tokenizer.decode(tokens), "prompt_tokens": len(prompt),
            "model": args.model, "tp": launch.world, "backend": args.backend, "device": args.device,
            "dtype": str(dtype).removeprefix("torch."), "load_s": round(t1 - t0, 3),
            "generate_s": round(t2 - t1, 3), "rank": launch.rank}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        result = run(args)
    except DistmkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result["rank"] == 0:
        del result["rank"]
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(result["text"] if result["text"] is not None else result["tokens"], flush=True)
            print(f"[{len(result['tokens'])} tokens in {result['generate_s']:.2f} s, tp={result['tp']}, "
                  f"{result['backend']} on {result['device']}]", file=sys.stderr)
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
