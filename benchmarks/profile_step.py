"""Time the megakernel's decode step and show where the time goes:
    python benchmarks/profile_step.py --model llama-3-8b --batch 1 --context 512 [--trace step.json]
Prints the median step time (CUDA-graph replays) and the per-task-type breakdown of one traced step."""
import argparse
import json

from distmk.kernels.bench import decode_engine, distmk_step_ms
from distmk.kernels.trace import breakdown, write_trace


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of one step here")
    p.add_argument("--options", default="{}", help='kernel options as JSON, e.g. {"block_n": 64}')
    args = p.parse_args()
    options = json.loads(args.options)
    result = distmk_step_ms(args.model, args.batch, args.context, args.iters, **options)
    print(json.dumps({"model": args.model, "batch": args.batch, "context": args.context, **options, **result}))
    engine = decode_engine(args.model, args.batch, args.context, trace=True, **options)
    engine.executor.launch()
    engine.executor.check()
    timings = engine.executor.timings()
    print(breakdown(engine.table, timings))
    if args.trace:
        write_trace(args.trace, engine.table, timings)


if __name__ == "__main__":
    main()
