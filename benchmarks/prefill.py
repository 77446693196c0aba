"""Time distmk's prefill chunk (runtime/prefill.py) against its FLOP roofline and a per-op PyTorch prefill of
the same weights; one JSON object.

    python benchmarks/prefill.py --model llama-3-8b --chunks 256,512,2048 --json --out benchmarks/results/x.json
    python benchmarks/prefill.py --model tiny-llama --device cpu --chunks 16,32 --baseline eager --iters 3
    python benchmarks/prefill.py --model llama-3-8b --chunks 512 --start 1536 --baseline none
    python benchmarks/prefill.py --model llama-3-8b --quantize fp8 --chunks 512 --baseline none

Each chunk is the first of a fresh sequence (positions 0..n-1), its KV blocks allocated as the batcher does for
a sequence of n tokens; with `--start S`, a later chunk (positions S..S+n-1, as a long prompt's chunks after the
first) of a sequence whose positions 0..S-1 an untimed chunk prefilled first; `--max-context` as a server's gives such
a chunk the key bucket it has there (runtime/prefill.py ChunkGraphs); `--last` times each chunk as its prompt's last,
which also gives the first token's logits (a cached prefix's suffix, in a server). The roofline is the chunk's FLOPs
(baselines.prefill_chunk_flops) at the GPU's dense bf16 tensor-core peak (distmk/graph/hardware.py's table); it
is null off a GPU, in float32, or on a GPU the table lacks. The baseline (baselines.build_torch_prefill) is
torch.compile'd by default; `--baseline eager` runs it uncompiled (Inductor takes a minute to compile even a
tiny model on a CPU). On a GPU each call is timed alone between CUDA events (distmk.timing.cuda_times), as the
server runs one chunk before a step; on the CPU by wall clock. One process, one GPU. Progress goes to stderr,
the JSON to stdout.
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import traceback

import torch
import transformers
import triton

from baselines import build_torch_prefill, prefill_chunk_flops
from decode import emit, git_commit
from harness import wall_times
from distmk.errors import DistmkError
from distmk.graph import GraphConfig
from distmk.graph.hardware import bf16_dense_flops
from distmk.runtime.engine import Engine
from distmk.runtime.prefill import PREFILL_FP8, prefill_chunk
from distmk.timing import cuda_times

BASELINES = ("compiled", "eager", "none")


def chunk_sizes(text: str) -> list[int]:
    """--chunks: a comma-separated list of positive token counts."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated token counts, e.g. 256,512,2048, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"every chunk must have at least 1 token, got {text!r}")
    return sizes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--chunks", type=chunk_sizes, default=[256, 512, 2048], help="tokens per chunk, one run each")
    p.add_argument("--iters", type=int, default=20, help="timed calls per chunk (after 3 untimed ones)")
    p.add_argument("--start", type=int, default=0,
                   help="time each chunk at positions START.. after an untimed prefill of 0..START-1")
    p.add_argument("--max-context", type=int, default=0,
                   help="the engine's context (default: --start plus the longest chunk); a server's (distmk.serve "
                        "--max-context) gives a later chunk the bucket of keys it has there")
    p.add_argument("--last", action="store_true",
                   help="time each chunk as its prompt's last, with its last position's logits (the first token's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--baseline", choices=BASELINES, default="compiled",
                   help="the per-op PyTorch prefill: torch.compile'd, uncompiled, or not run")
    p.add_argument("--eager-prefill", action="store_true",
                   help="run distmk's element-wise prefill stages op by op (by default a GPU torch.compiles them)")
    p.add_argument("--no-prefill-graphs", action="store_true",
                   help="launch distmk's chunks op by op (by default a GPU replays them as CUDA graphs)")
    p.add_argument("--json", action="store_true", help="print the JSON on one line (default: indented)")
    p.add_argument("--quantize", choices=("fp8",),
                   help="the model's FP8 twin as the megakernel streams it (kernel option stream_e4m3 1): its products "
                        "held in e4m3 alone, multiplied as --prefill-fp8 says")
    p.add_argument("--prefill-fp8", choices=PREFILL_FP8,
                   help="with --quantize fp8: each chunk's activations quantized to e4m3 (torch._scaled_mm), or the "
                        "products dequantized a layer at a time (default: w8a8 on Hopper, else w8a16)")
    p.add_argument("--out", help="also write the JSON to this file")
    args = p.parse_args(argv)
    if args.iters < 1:
        p.error(f"argument --iters: must be >= 1, got {args.iters}")
    if args.start < 0:
        p.error(f"argument --start: must be >= 0, got {args.start}")
    if args.max_context and args.max_context < args.start + max(args.chunks):
        p.error(f"argument --max-context: must hold --start plus the longest chunk ({args.start + max(args.chunks)}), "
                f"got {args.max_context}")
    if args.start and args.baseline != "none":
        p.error("argument --start: the PyTorch baseline prefills a first chunk only: use --baseline none")
    return args


def prefill_engine(model: str, device: torch.device, dtype, max_context: int, compile_prefill: bool | None = None,
                   graphs: bool = True, quantize: str | None = None, prefill_fp8: str | None = None) -> Engine:
    """An Engine with KV-cache room for one sequence of max_context tokens, in chunks of up to that many.
    Its decode executor is the reference one whatever the device (a prefill chunk never runs it, and the
    megakernel would compile and autotune for nothing), but for an FP8 twin: the megakernel's, never launched,
    whose weights hold the e4m3 products alone."""
    config = GraphConfig(batch=1, workers=1)
    backend, options = ("triton", {"stream_e4m3": 1}) if quantize else ("reference", None)
    return Engine(model, backend=backend, device=device, dtype=dtype, config=config, max_context=max_context,
                  max_seqs=1, prefill_chunk=max_context, compile_prefill=compile_prefill, prefill_graphs=graphs,
                  quantize=quantize, kernel_options=options, autotune=False, prefill_fp8=prefill_fp8)


def time_ms(fn, device: torch.device, iters: int) -> float:
    """Median ms of one call of `fn`: CUDA events around each call on a GPU, wall clock on the CPU."""
    times = cuda_times(fn, iters) if device.type == "cuda" else wall_times(fn, iters)
    return statistics.median(times)


def run(args, log) -> dict:
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    peak = bf16_dense_flops(device) if dtype == torch.bfloat16 else None
    block = 16
    context = -(-(args.max_context or args.start + max(args.chunks)) // block) * block
    engine = prefill_engine(args.model, device, dtype, max_context=context,
                            compile_prefill=False if args.eager_prefill else None, graphs=not args.no_prefill_graphs,
                            quantize=args.quantize, prefill_fp8=args.prefill_fp8)
    spec, kv = engine.spec, engine.kv
    baseline = baseline_error = None
    if args.baseline != "none":
        try:
            built = build_torch_prefill(spec, engine.weights, engine.max_context)
        except ValueError as e:           # a model it has no layers for (mixture of experts): distmk's figures alone
            log(f"no PyTorch baseline: {e}")
            baseline_error = str(e)
        else:
            # dynamic: one compilation serves the later chunk sizes (the products are cuBLAS calls either way)
            baseline = torch.compile(built.prefill, dynamic=True) if args.baseline == "compiled" else built.prefill
    log(f"{args.model} on {torch.cuda.get_device_name(device) if on_gpu else 'cpu'}, {dtype}; bf16 tensor-core "
        f"peak {f'{peak / 1e12:.0f} TFLOP/s' if peak else 'unknown: no roofline'}")

    generator = torch.Generator().manual_seed(0)
    chunks = []
    with torch.inference_mode():
        for n in args.chunks:
            tokens = torch.randint(0, spec.vocab_size, (n,), generator=generator)
            blocks = kv.allocate([], args.start + n)          # what Batcher._admit gives a fresh sequence
            token_list = tokens.tolist()
            try:
                if args.start:
                    prefill_chunk(engine, torch.randint(0, spec.vocab_size, (args.start,), generator=generator)
                                  .tolist(), 0, blocks)
                distmk_ms = time_ms(lambda: prefill_chunk(engine, token_list, args.start, blocks, last=args.last),
                                    device, args.iters)
            finally:
                kv.release(blocks)
            flops = prefill_chunk_flops(spec, engine.plan, n, args.start)
            roofline_ms = flops / peak * 1e3 if peak else None
            record = {"tokens": n, "start": args.start, "last": args.last, "flops": flops, "distmk_ms": distmk_ms,
                      "distmk_tflops_per_s": flops / distmk_ms / 1e9, "roofline_ms": roofline_ms,
                      "roofline_fraction": roofline_ms / distmk_ms if roofline_ms else None,
                      "torch_ms": None, "speedup_vs_torch": None}
            if baseline is not None:
                device_tokens = tokens.to(device)
                try:          # a baseline that fails to compile leaves distmk's figures standing
                    record["torch_ms"] = time_ms(lambda: baseline(device_tokens), device, args.iters)
                    record["speedup_vs_torch"] = record["torch_ms"] / distmk_ms
                except Exception as e:  # noqa: BLE001 - recorded, whatever it was
                    log(traceback.format_exc())
                    record["torch_error"] = f"{type(e).__name__}: {e}"
            log(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
            chunks.append(record)
            if on_gpu:
                torch.cuda.empty_cache()
    return {"model": args.model, "params": spec.num_parameters(), "dtype": str(dtype).removeprefix("torch."),
            "quantize": args.quantize, "e4m3_products": sorted(engine.weights.fp8),
            "prefill_fp8": engine.prefill_fp8 if engine.weights.fp8 else None,
            "max_context": engine.max_context, "device": args.device,
            "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
            "bf16_dense_flops_per_s": peak, "distmk_prefill_compiled": engine.compile_prefill,
            "distmk_prefill_graphs": engine.prefill_graphs is not None, "torch_baseline": args.baseline,
            "torch_baseline_error": baseline_error, "iters": args.iters, "chunks": chunks,
            "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", *sys.argv]), "distmk_commit": git_commit()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is visible (use --device cpu)", file=sys.stderr)
        return 2

    def log(msg):
        print(f"[prefill] {msg}", file=sys.stderr, flush=True)

    try:
        result = run(args, log)
    except DistmkError as e:             # e.g. a chunk longer than the model's context
        print(f"error: --chunks up to {max(args.chunks)} tokens{f' from --start {args.start}' if args.start else ''}: "
              f"{e}", file=sys.stderr)
        return 2
    emit(result, args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
