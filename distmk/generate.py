"""python -m distmk.generate: generate from a prompt, alone (tp=1) or under torchrun / mpirun (tp=N).

With --json, rank 0 prints one line: {"tokens": [...], "text": ..., ...}; other ranks print nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from distmk.cli import add_engine_args, build_engine, open_comm, run_virtual_ranks, select_device
from distmk.dist import detect_launch
from distmk.errors import DistmkError
from distmk.flags import COUNT, NON_NEGATIVE, PROBABILITY, SEED, float_in
from distmk.runtime.sampling import resolve_sampling
from distmk.runtime.tokenizer import load_tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m distmk.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p, "--batch", "rows per step (prefill chunk)", step_batches_default="1")   # one sequence
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenizer of the checkpoint; bytes for presets)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=COUNT, default=32)
    p.add_argument("--temperature", type=float_in(0), default=None,
                   help="0 = greedy (default: the checkpoint's generation_config.json, else 0)")
    p.add_argument("--top-p", type=PROBABILITY, default=None, help="default: the checkpoint's, else 1")
    p.add_argument("--top-k", type=NON_NEGATIVE, default=None, help="0 = no limit (default: the checkpoint's, else 0)")
    p.add_argument("--min-p", type=float_in(0, 1), default=None,
                   help="leave out tokens less likely than this times the most likely one's (default: the "
                        "checkpoint's, else 0)")
    p.add_argument("--sample-seed", type=SEED, default=0, help="seed of the sampling (temperature > 0)")
    p.add_argument("--repetition-penalty", type=float_in(0, lo_open=True), default=None,
                   help="transformers' repetition penalty, > 0 (default: the checkpoint's, else 1 = none)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--trace", metavar="OUT.json",
                   help="triton backend: write a Chrome/Perfetto trace of the last step and print the "
                        "time per task type")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON line")
    return p.parse_args(argv)


def run(args) -> dict:
    launch = detect_launch()
    device = select_device(args, launch)
    if args.virtual_tp > 1:
        return run_virtual_ranks(args, launch, lambda rank_launch, comm: run_with(args, rank_launch, comm, device))[0]
    comm = open_comm(args, launch)
    try:
        return run_with(args, launch, comm, device)
    finally:
        if hasattr(comm, "close"):    # NVSHMEM: free symmetric memory and finalize, or the process hangs at exit
            comm.close()


def run_with(args, launch, comm, device) -> dict:
    t0 = time.perf_counter()
    if args.trace and args.backend != "triton":
        raise DistmkError("--trace needs --backend triton")
    engine = build_engine(args, launch, comm, device, progress=launch.rank == 0 and not args.json, max_seqs=1,
                          kernel_options={"trace": bool(args.trace)})
    tokenizer = load_tokenizer(engine.tokenizer_dir, engine.spec.vocab_size)
    if args.prompt is not None:
        prompt = tokenizer.encode(args.prompt)
    else:
        try:
            prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise DistmkError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    t1 = time.perf_counter()
    params = resolve_sampling(args.temperature, args.top_p, args.top_k, args.sample_seed,
                              defaults=engine.spec.generation_defaults, greedy_default=True,
                              repetition_penalty=args.repetition_penalty, min_p=args.min_p)
    tokens = engine.generate(prompt, args.max_new_tokens, params, stop_on_eos=not args.ignore_eos)
    t2 = time.perf_counter()
    if args.trace:
        from distmk.kernels.trace import breakdown, write_trace
        executor = engine.last_executor                  # the last step's table
        timings = executor.timings()
        write_trace(args.trace, executor.table, timings, launch.rank)
        print(breakdown(executor.table, timings), file=sys.stderr)
    return {"tokens": tokens, "text": tokenizer.decode(tokens), "prompt_tokens": len(prompt),
            "model": args.model, "tp": launch.world, "backend": args.backend, "device": args.device,
            "dtype": str(engine.dtype).removeprefix("torch."), "load_s": round(t1 - t0, 3),
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
