"""Time one decode step of distmk against its HBM roofline and against PyTorch baselines; one JSON object.

    python benchmarks/decode.py --model llama-3-8b --batch 1 --context 1024 --json --out benchmarks/results/x.json
    torchrun --standalone --nproc-per-node 2 benchmarks/decode.py --model llama-3-8b --batch 1 --context 1024
    python benchmarks/decode.py --model tiny-llama --backend reference --device cpu --context 64 --iters 20
    python benchmarks/decode.py --model qwen3-30b-a3b --batch 8 --context 512 --skip-hf --compile-baseline
    python benchmarks/decode.py --model llama-3-8b --batch 1 --context 512 --virtual-tp 2 --skip-hf --compile-baseline

Measured in one process: the GPU's streaming-read bandwidth, distmk's step (harness.py), the
per-op PyTorch decoder replayed as a CUDA graph (and torch.compile'd with --compile-baseline), and
transformers' eager generate. Under torchrun every rank runs tensor parallel over NCCL (transformers alone
runs on rank 0, on one GPU) and rank 0 prints. Progress goes to stderr, the JSON to stdout.
With --virtual-tp N (one GPU, no torchrun) distmk's step runs at tp=1 and then as N virtual ranks sharing the GPU
(threads, SMs // N workers each, exchanging through peer pointers as ranks of one node do): step_ms is the
virtual ranks' step, tp1_step_ms the tp=1 one of the same process, and the roofline and baselines are the tp=1
ones (the same GPU reads every shard). A measurement of what the exchanges cost, not of a multi-GPU speed-up.
Where distmk streams e4m3 products (--quantize fp8 or an FP8 checkpoint, with --stream-e4m3 1), the same process
also times its step on the same weights in bf16 (bf16_step_ms) and, with --compile-baseline, the compiled decoder
multiplying the e4m3 products two ways: cudagraph_compiled_fp8_ms dequantized within the step (weight-only, which
torch.compile fuses into the products), cudagraph_compiled_w8a8_ms with the products' inputs quantized a row and 128
columns and multiplied in e4m3 by torch._scaled_mm (a MoE model's experts stay weight-only);
cudagraph_compiled_ms stays the compiled decoder on the bf16 weights.
On the CPU (--device cpu, the reference backend, float32, gloo between ranks) the HBM roofline and the
CUDA-graph baselines do not apply and are recorded as null; distmk and transformers are timed by wall clock.

The PyTorch decoder runs on distmk's own weights (its engine's, kept after the timing: one copy in memory,
which mixtral-8x7b's 94 GB in bf16 needs) from distmk's KV cache, tokens and positions, so both run the same
step. For a mixture-of-experts model the roofline counts, in each sparse layer, the router and the experts the
step chose (the union over its rows: experts_read_per_layer), as distmk's route tasks kept them
(route_history); route_agreement is the fraction of (sparse layer, row) pairs for which the PyTorch decoder's
router, one eager step from the same state, chose the same experts (its timed steps read those).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import transformers
import triton

from baselines import (COMPILE_MODES, FP8_RECIPES, cudagraph_step_ms, decode_step_bytes, distinct_experts,
                       hf_eager_ms_per_token, measure_hbm_read_bandwidth, paged_state, routed_experts, tp_rank)
from distmk.cli import add_kernel_args, add_quantize_arg, kernel_options_of, select_device
from distmk.dist import detect_launch, init_process_group
from distmk.errors import DistmkError
from distmk.flags import COUNT
from distmk.graph.flags import add_graph_args, tiling_of
from distmk.models.shard import load_shard, plan_shard
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
    p.add_argument("--compile-mode", choices=sorted(COMPILE_MODES), default="max-autotune",
                   help="how --compile-baseline compiles (baselines.COMPILE_MODES): max-autotune, the yardstick, "
                        "or coordinate-descent (no matmul templates to tune: less compile time; a gathered expert's "
                        "products still read its weights in place) or default")
    p.add_argument("--virtual-tp", type=COUNT, default=1, metavar="N",
                   help="also time distmk's step as N tensor-parallel ranks sharing this one GPU (a measurement "
                        "mode: see above)")
    p.add_argument("--no-breakdown", action="store_true",
                   help="triton: skip the traced step (where the time went), which compiles the megakernel again")
    add_graph_args(p, "one per SM")
    add_kernel_args(p)
    add_quantize_arg(p)
    p.add_argument("--backend", choices=["triton", "reference"], default="triton",
                   help="distmk's executor: the megakernel, or the reference executor (the one CPU runs have)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = p.parse_args(argv)
    if args.backend == "triton" and args.device == "cpu":
        p.error("--backend triton needs --device cuda")
    if args.virtual_tp > 1 and args.backend != "triton":
        p.error("--virtual-tp needs --backend triton")
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


def time_distmk(args, device, log, keep: dict | None, virtual_tp: int = 1, breakdown: bool = True,
                **kernel_options) -> dict:
    """distmk's own step timing (of `virtual_tp` virtual ranks where > 1; `kernel_options` over the flags'; with the
    traced step's breakdown unless `breakdown` is False or the flags say so); if it cannot be imported or fails, the
    error instead, so that the baselines still come out. `keep` receives the engine (harness.distmk_step_ms)."""
    try:
        from harness import distmk_step_ms, virtual_tp_step_ms
        options = dict(backend=args.backend, device=device,
                       breakdown=breakdown and args.backend == "triton" and not args.no_breakdown,
                       graph=tiling_of(args), workers=args.workers, quantize=args.quantize,
                       **{**kernel_options_of(args), **kernel_options})
        if virtual_tp > 1:
            return virtual_tp_step_ms(args.model, args.batch, args.context, virtual_tp, args.iters, **options)
        return distmk_step_ms(args.model, args.batch, args.context, args.iters, keep=keep, **options)
    except Exception as e:
        log(traceback.format_exc())
        return {"step_ms": None, "distmk_error": f"{type(e).__name__}: {e}"}


def breakdown_lines(distmk: dict, log) -> None:
    """Log the traced step's breakdown and keep it in the JSON as lines: the trace is what says what limits it."""
    breakdown = distmk.pop("breakdown", "")
    log(breakdown)
    log(f"distmk: {distmk}")
    if breakdown:
        distmk["breakdown"] = breakdown.splitlines()


def run(args, launcher: str, log) -> dict:
    world, rank = tp_rank()
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32

    def release():
        """Return cached GPU memory; after a kernel fault the context is unusable and this raises too, so it says
        nothing: the fault itself is recorded where it happened."""
        if on_gpu:
            try:
                torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def peak_gb(reset: bool = False) -> float | None:
        try:
            peak = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
            if reset:
                torch.cuda.reset_peak_memory_stats(device)
            return peak
        except Exception:  # noqa: BLE001 - as release()
            return None

    errors = {}

    def attempt(what: str, fn):
        """fn(), or None with the error logged and recorded under `what`: one rank alone, where a failing baseline
        leaves the other figures standing (tensor-parallel ranks raise: a peer would wait in NCCL for ever)."""
        if world > 1:
            return fn()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded, whatever it was
            log(traceback.format_exc())
            errors[what] = f"{type(e).__name__}: {e}"
            release()
            return None

    spec, source, _ = open_model(args.model, seed=0, device=device)
    result = {"model": args.model, "params": spec.num_parameters(), "tp": world, "batch": args.batch,
              "context": args.context, "dtype": str(dtype).removeprefix("torch."), "backend": args.backend,
              "device": args.device}

    plan = plan_shard(spec, world, rank)
    phase_s = {}
    t0 = time.perf_counter()
    bandwidth = None
    if on_gpu:
        bandwidth = measure_hbm_read_bandwidth(device)
        log(f"HBM read {bandwidth / 1e12:.2f} TB/s")

    t1 = time.perf_counter()
    keep = {}
    distmk = time_distmk(args, device, log, keep)
    step_ms = distmk["step_ms"]
    breakdown_lines(distmk, log)
    phase_s["distmk"] = round(time.perf_counter() - t1, 1)
    release()
    peaks = {}
    if on_gpu:       # what distmk held at most, then what the baselines added on top of its engine
        peaks["distmk"] = peak_gb(reset=True)

    # the baselines and the routing run on distmk's weights and from its step's state; a copy of their own only
    # where its engine could not be built
    engine = keep.get("engine")
    weights = state = None
    if engine is not None:
        weights = engine.weights
        state = paged_state(engine.kv.k, engine.kv.v, keep["blocks"], keep["tokens"], keep["positions"])
    elif on_gpu or spec.moe_layers:
        gc.collect()
        release()
        log("no distmk engine: the baselines load the weights themselves")
        weights = attempt("weights", lambda: load_shard(spec, source, plan, dtype, device))
    result["baseline_weights"] = "distmk's" if engine is not None else "loaded"

    experts_read = experts_source = route_agreement = None
    if spec.moe_layers:
        # the experts of distmk's timed step, every sparse layer's (the route tasks keep them), and the PyTorch
        # decoder's router's from the same state: the baselines' step chooses as distmk's did, up to rounding
        ours = workspace(engine)["route_history"][:, :args.batch].cpu() if engine is not None and step_ms else None
        theirs = attempt("routing", lambda: routed_experts(spec, weights, args.batch, args.context, device, dtype,
                                                           state))
        if ours is not None or theirs is not None:
            experts_read = distinct_experts(ours if ours is not None else theirs)
            experts_source = "distmk's step" if ours is not None else "the PyTorch decoder's router"
        if ours is not None and theirs is not None:
            route_agreement = (ours.sort(-1).values == theirs.sort(-1).values).all(-1).float().mean().item()
        log(f"experts read per sparse layer (of {spec.num_experts}, {experts_source}): {experts_read}; (layer, row) "
            f"pairs where the PyTorch decoder's router chose the same experts: {route_agreement}")
    e4m3 = sorted(engine.weights.fp8) if engine is not None else []      # the products its ring streams in e4m3
    step_bytes = decode_step_bytes(spec, plan, args.batch, args.context, dtype.itemsize, experts_read, e4m3)
    result.update(quantize=args.quantize, e4m3_products=e4m3)
    roofline_ms = step_bytes / bandwidth * 1e3 if bandwidth else None
    if on_gpu:
        log(f"{step_bytes / 1e9:.2f} GB per step -> roofline {roofline_ms:.3f} ms")

    cudagraph_ms = compiled_ms = None
    compiled_fp8_ms = {}
    if on_gpu:
        t1 = time.perf_counter()
        cudagraph_ms = attempt("cudagraph", lambda: cudagraph_step_ms(
            spec, source, args.batch, args.context, iters=args.iters, weights=weights, state=state))
        log(f"PyTorch ops in a CUDA graph: {cudagraph_ms} ms")
        phase_s["cudagraph"] = round(time.perf_counter() - t1, 1)
        release()
        if args.compile_baseline:
            t1 = time.perf_counter()
            compiled_ms = attempt("compiled", lambda: cudagraph_step_ms(
                spec, source, args.batch, args.context, compile=True, iters=args.iters, weights=weights, state=state,
                compile_mode=args.compile_mode))
            log(f"torch.compile'd ({args.compile_mode}) ops in a CUDA graph: {compiled_ms} ms")
            phase_s["compiled"] = round(time.perf_counter() - t1, 1)
            release()
        if args.compile_baseline and e4m3:      # distmk's engine is done: its ring's column order undone
            weights.order_fp8(None)
        for recipe in FP8_RECIPES if args.compile_baseline and e4m3 else ():   # the same on the e4m3 products
            t1 = time.perf_counter()
            compiled_fp8_ms[recipe] = attempt(f"compiled_{recipe}", lambda: cudagraph_step_ms(
                spec, source, args.batch, args.context, compile=True, iters=args.iters, weights=weights, state=state,
                compile_mode=args.compile_mode, fp8=recipe))
            log(f"torch.compile'd ({args.compile_mode}) ops on the e4m3 products ({recipe}) in a CUDA graph: "
                f"{compiled_fp8_ms[recipe]} ms")
            phase_s[f"compiled_{recipe}"] = round(time.perf_counter() - t1, 1)
            release()
        peaks["baselines"] = peak_gb()
    else:
        log("no HBM roofline and no CUDA-graph baselines on the CPU: recorded as null")
    # transformers loads a copy of its own: distmk's goes first
    engine = weights = state = None
    keep.clear()
    gc.collect()
    release()

    bf16 = None
    if e4m3:                        # distmk's step on the same weights in bf16: what streaming e4m3 gains
        t1 = time.perf_counter()
        bf16 = time_distmk(args, device, log, None, breakdown=False, stream_e4m3=0)
        phase_s["distmk_bf16"] = round(time.perf_counter() - t1, 1)
        release()

    virtual = None
    if args.virtual_tp > 1:         # the tp=1 engine is gone: the GPU is the virtual ranks' alone
        t1 = time.perf_counter()
        virtual = time_distmk(args, device, log, None, args.virtual_tp)
        breakdown_lines(virtual, log)
        phase_s["virtual_tp"] = round(time.perf_counter() - t1, 1)
        release()
        result.update(virtual_tp=args.virtual_tp, tp1_step_ms=step_ms, tp1_distmk=distmk,
                      step_vs_tp1=virtual["step_ms"] / step_ms if virtual["step_ms"] and step_ms else None)
        distmk, step_ms = virtual, virtual["step_ms"]

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

    def speedup(baseline_ms):
        return baseline_ms / step_ms if step_ms and baseline_ms else None

    result.update({
        "step_ms": step_ms,
        "distmk_mode": distmk.get("mode"),
        "distmk_error": distmk.get("distmk_error"),
        "allreduce_us": distmk.get("allreduce_us"),
        "push_to_consume_us": distmk.get("push_to_consume_us"),
        "peer_wait_fraction": distmk.get("peer_wait_fraction"),
        "roofline_ms": roofline_ms,
        "efficiency": roofline_ms / step_ms if step_ms and roofline_ms else None,
        "step_bytes": step_bytes,
        "experts_read_per_layer": experts_read,
        "experts_read_source": experts_source,
        "route_agreement": route_agreement,
        "hbm_bytes_per_s": bandwidth,
        "hf_eager_ms": hf_ms,
        "hf_eager_tp": 1,
        "cudagraph_ms": cudagraph_ms,
        "cudagraph_compiled_ms": compiled_ms,
        "compile_mode": args.compile_mode if compiled_ms is not None else None,
        "speedup_vs_hf": speedup(hf_ms),
        "speedup_vs_cudagraph": speedup(cudagraph_ms),
        "speedup_vs_compiled": speedup(compiled_ms),     # the yardstick
        "cudagraph_compiled_fp8_ms": compiled_fp8_ms.get("w8a16"),
        "speedup_vs_compiled_fp8": speedup(compiled_fp8_ms.get("w8a16")),
        "cudagraph_compiled_w8a8_ms": compiled_fp8_ms.get("w8a8"),
        "speedup_vs_compiled_w8a8": speedup(compiled_fp8_ms.get("w8a8")),
        "bf16_step_ms": bf16["step_ms"] if bf16 else None,
        "speedup_vs_bf16": speedup(bf16["step_ms"] if bf16 else None),
        "bf16_distmk": bf16,
        "baseline_errors": errors or None,
        "distmk": distmk,
        "phase_s": {**phase_s, "total": round(time.perf_counter() - t0, 1)},
        "gpu_peak_gb": peaks or None,
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


def workspace(engine) -> dict:
    """The workspace of the engine's last step (the triton executor's buffers, the reference one's context)."""
    executor = engine.last_executor
    return executor.buf if hasattr(executor, "buf") else executor.ctx.buf


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
