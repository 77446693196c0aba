"""Time one decode step of distmk against its HBM roofline and against PyTorch baselines; one JSON object.

    python benchmarks/decode.py --model llama-3-8b --batch 1 --context 1024 --json --out benchmarks/results/x.json
    torchrun --standalone --nproc-per-node 2 benchmarks/decode.py --model llama-3-8b --batch 1 --context 1024
    python benchmarks/decode.py --model tiny-llama --backend reference --device cpu --context 64 --iters 20

Measured in one process: the GPU's streaming-read bandwidth, distmk's step (harness.py), the
per-op PyTorch decoder replayed as a CUDA graph (and torch.compile'd with --compile-baseline), and
transformers' eager generate. Under torchrun every rank runs tensor parallel over NCCL (transformers alone
runs on rank 0, on one GPU) and rank 0 prints. Progress goes to stderr, the JSON to stdout.
On the CPU (--device cpu, the reference backend, float32, gloo between ranks) the HBM roofline and the
CUDA-graph baselines do not apply and are recorded as null; distmk and transformers are timed by wall clock.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist
import transformers
import triton

from baselines import (cudagraph_step_ms, decode_step_bytes, hf_eager_ms_per_token, measure_hbm_read_bandwidth,
                       tp_rank)
from distmk.cli import COUNT, add_graph_args, add_kernel_args, kernel_options_of, select_device, tiling_of
from distmk.dist import detect_launch, init_process_group
from distmk.errors import DistmkError
from distmk.models.shard import plan_shard
from distmk.models.weights import open_model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--batch", type=COUNT, default=1, help="rows per decode step")
    p.add_argument("--context", type=COUNT, default=1024, help="positions each row attends to (it sits at context - 1)")
    p.add_argument("--iters", type=COUNT, default=200, help="timed steps of distmk and the CUDA-graph baselines")
    p.add_argument("--json", action="store_true", help="print the JSON on one line (default: indented)")
    p.add_argument("--out", help="also write the JSON to this file")
    p.add_argument("--skip-hf", action="store_true", help="skip transformers' eager generate")
    p.add_argument("--compile-baseline", action="store_true", help="also time the torch.compile'd CUDA graph")
    add_graph_args(p, "one per SM")
    add_kernel_args(p)
    p.add_argument("--backend", choices=["triton", "reference"], default="triton",
                   help="distmk's executor: the megakernel, or the reference executor (the one CPU runs have)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    if args.backend == "triton" and args.device == "cpu":
        p.error("--backend triton needs --device cuda")
    return args


def git_commit() -> str | None:
    """The distmk commit this ran (with '+' if the tree had changes), or None outside a git checkout;
    $DISTMK_COMMIT when set (a copy of the tree whose own git history is not the source's)."""
    if os.environ.get("DISTMK_COMMIT"):
        return os.environ["DISTMK_COMMIT"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+" if dirty else "")


def time_distmk(args, device, log) -> dict:
    """distmk's own step timing; if it cannot be imported or fails, the error instead, so that the
    baselines still come out."""
    try:
        from harness import distmk_step_ms
        return distmk_step_ms(args.model, args.batch, args.context, args.iters, backend=args.backend, device=device,
                              breakdown=args.backend == "triton", graph=tiling_of(args), workers=args.workers,
                              **kernel_options_of(args))
    except Exception as e:
        log(traceback.format_exc())
        return {"step_ms": None, "distmk_error": f"{type(e).__name__}: {e}"}


def run(args, launcher: str, log) -> dict:
    world, rank = tp_rank()
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    release = torch.cuda.empty_cache if on_gpu else (lambda: None)
    spec, source, _ = open_model(args.model, seed=0, device=device)
    result = {"model": args.model, "params": spec.num_parameters(), "tp": world, "batch": args.batch,
              "context": args.context, "dtype": str(dtype).removeprefix("torch."), "backend": args.backend,
              "device": args.device}

    step_bytes = decode_step_bytes(spec, plan_shard(spec, world, rank), args.batch, args.context, dtype.itemsize)
    bandwidth = roofline_ms = None
    if on_gpu:
        bandwidth = measure_hbm_read_bandwidth(device)
        roofline_ms = step_bytes / bandwidth * 1e3
        log(f"HBM read {bandwidth / 1e12:.2f} TB/s; {step_bytes / 1e9:.2f} GB per step -> roofline "
            f"{roofline_ms:.3f} ms")

    distmk = time_distmk(args, device, log)
    step_ms = distmk["step_ms"]
    log(distmk.pop("breakdown", ""))
    log(f"distmk: {distmk}")
    release()

    cudagraph_ms = compiled_ms = None
    if on_gpu:
        cudagraph_ms = cudagraph_step_ms(spec, source, args.batch, args.context, iters=args.iters)
        log(f"PyTorch ops in a CUDA graph: {cudagraph_ms:.3f} ms")
        release()
        if args.compile_baseline:
            compiled_ms = cudagraph_step_ms(spec, source, args.batch, args.context, compile=True, iters=args.iters)
            log(f"torch.compile'd ops in a CUDA graph: {compiled_ms:.3f} ms")
            release()
    else:
        log("no HBM roofline and no CUDA-graph baselines on the CPU: recorded as null")

    hf_ms = None
    if not args.skip_hf:
        if rank == 0:
            hf_ms = hf_eager_ms_per_token(spec, source, args.batch, args.context, dtype=dtype, device=device)
            log(f"transformers eager generate (1 {'GPU' if on_gpu else 'process'}): {hf_ms:.3f} ms/token")
            release()
        if world > 1 and on_gpu:
            dist.barrier(device_ids=[device.index])
        elif world > 1:
            dist.barrier()

    result.update({
        "step_ms": step_ms,
        "distmk_mode": distmk.get("mode"),
        "distmk_error": distmk.get("distmk_error"),
        "allreduce_us": distmk.get("allreduce_us"),
        "peer_wait_fraction": distmk.get("peer_wait_fraction"),
        "roofline_ms": roofline_ms,
        "efficiency": roofline_ms / step_ms if step_ms and roofline_ms else None,
        "step_bytes": step_bytes,
        "hbm_bytes_per_s": bandwidth,
        "hf_eager_ms": hf_ms,
        "hf_eager_tp": 1,
        "cudagraph_ms": cudagraph_ms,
        "cudagraph_compiled_ms": compiled_ms,
        "speedup_vs_hf": hf_ms / step_ms if step_ms and hf_ms else None,
        "speedup_vs_cudagraph": cudagraph_ms / step_ms if step_ms and cudagraph_ms else None,
        "speedup_vs_compiled": compiled_ms / step_ms if step_ms and compiled_ms else None,     # the yardstick
        "distmk": distmk,
        "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "launcher": launcher,
        "distmk_commit": git_commit(),
    })
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    launch = detect_launch()
    lead = launch.rank == 0

    def log(msg):
        if lead:
            print(f"[decode] {msg}", file=sys.stderr, flush=True)

    try:
        select_device(args, launch)
    except DistmkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        # The H200 hosts this runs on need NVLink multicast off (see launch/env.sh).
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    init_process_group(launch, "nccl" if args.device == "cuda" else "gloo")
    try:
        result = run(args, launch.launcher, log)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if lead:
        emit(result, args.json, args.out)
    return 0


def emit(result: dict, one_line: bool, out: str | None) -> None:
    """A benchmark's JSON on stdout (indented unless `one_line`), and in `out` if given."""
    text = json.dumps(result, indent=None if one_line else 2, default=str)
    print(text, flush=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
