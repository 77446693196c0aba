"""Machine code of the megakernel, compiled for sm_90 without a GPU: SASS bytes in all, and per source file (line
info), where `--lines N` adds the N heaviest source lines.

    python benchmarks/code_size.py --model qwen3-30b-a3b --batch 1 --options '{"ring_attention_keys": 2}'

Why it is worth a number: every worker runs every task type of a layer in turn, so a layer's code has to come
through each SM's instruction cache again and again, and the latency-bound tasks (attention, the route, the
reductions) wait on it. Doubling the code a qwen3-8b layer runs (the same tasks, a second copy of their code for
odd layers) took its step from 4.10 to 4.77 ms and its attention tasks from 5.4 to 14.8 us
(benchmarks/results/h200-2026-12-03-f34d4db). Uses the nvdisasm that Triton ships.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from distmk.flags import COUNT
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine

_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/")       # an instruction's address column
_SPILL = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?P\w+\s+)?(STL|LDL)\b")   # local memory: ptxas's spills


def nvdisasm() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def instructions_by_line(cubin: bytes) -> collections.Counter:
    """Instructions of the cubin counted by the source line (file:line) they come from, and the spill stores and
    loads under the keys "STL" and "LDL"."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([nvdisasm(), "-g", "-c", f.name], capture_output=True, text=True, check=True).stdout
    count, line = collections.Counter(), "?"
    for text in listing.splitlines():
        found = _LINE.search(text)
        if found:
            line = f"{os.path.basename(found.group(1))}:{found.group(2)}"
        elif _INSTRUCTION.search(text):
            count[line] += 1
            spill = _SPILL.search(text)
            if spill:
                count[spill.group(1)] += 1
    return count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--batch", type=COUNT, default=1, help="rows per step")
    p.add_argument("--kernel", default="ring", choices=("ring", "tl"))
    p.add_argument("--options", default="{}", help="more kernel options, a JSON object (kernels/options.py)")
    p.add_argument("--quantize", choices=("fp8",), help="the model's FP8 twin (with the option stream_e4m3: 1, the "
                                                        "kernel that streams e4m3 weights)")
    p.add_argument("--lines", type=int, default=0, help="also list the N source lines with the most instructions")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args(argv)
    engine = Engine(args.model, backend="triton", device="meta", dtype=torch.bfloat16, max_context=1024,
                    config=GraphConfig(batch=args.batch, workers=132),
                    kernel_options={"kernel": args.kernel, **json.loads(args.options)}, quantize=args.quantize)
    by_line = instructions_by_line(engine.executor.compile_ahead(arch=90).asm["cubin"])
    spills = {op: by_line.pop(op, 0) for op in ("STL", "LDL")}
    by_file = collections.Counter()
    for line, n in by_line.items():
        by_file[line.split(":")[0]] += n
    total = sum(by_line.values())
    if args.json:        # SASS instructions are 16 bytes each on sm_90
        print(json.dumps({"model": args.model, "batch": args.batch, "kernel": args.kernel, "quantize": args.quantize,
                          "sass_bytes": 16 * total,
                          "spill_stores": spills["STL"], "spill_loads": spills["LDL"],
                          "by_file": {f: 16 * n for f, n in by_file.most_common()}}))
        return 0
    print(f"{args.model} b{args.batch} {args.kernel} kernel: {total} instructions, {16 * total / 1024:.1f} KB of SASS, "
          f"{spills['STL']} spill stores and {spills['LDL']} loads")
    for name, n in by_file.most_common():
        print(f"  {16 * n / 1024:7.1f} KB  {name}")
    for line, n in by_line.most_common(args.lines):
        print(f"  {16 * n / 1024:7.1f} KB  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
