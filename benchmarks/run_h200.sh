#!/usr/bin/env bash
# One device session on an H200: GPU tests, the decode benchmarks (JSON for benchmarks/results/), and
# start-up times. Usage, from the repository root: OUT=dir bash benchmarks/run_h200.sh [MODEL:BATCH ...]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -s tests/test_gpu.py 2>&1 | grep -v Warn | tee "$OUT/gpu_tests.log" | tail -n 6

for spec in "${@:-llama-3-8b:1 llama-3-8b:8 qwen3-8b:1 qwen3-8b:8 llama-3.2-1b:1}"; do
  for one in $spec; do
    model=${one%:*} batch=${one#*:}
    timeout 120 python3 benchmarks/decode.py --model "$model" --batch "$batch" --context 512 --iters 100 --json \
        --out "$OUT/decode_${model}_b${batch}_tp1.json" 2>/dev/null | python3 -c "
import json, sys
r = json.loads(sys.stdin.read())
print(f\"{r['model']:<13} b={r['batch']} step {r['step_ms']:.3f} ms  roofline {r['roofline_ms']:.2f}  eff {r['efficiency']:.2f}  graph {r['cudagraph_ms']:.2f}  hf {r['hf_eager_ms']:.1f}\")"
  done
done

# start-up: process start to first token, with empty Triton and distmk caches (cold, autotuning) and warm
export TRITON_CACHE_DIR=/tmp/distmk_triton_cache DISTMK_CACHE_DIR=/tmp/distmk_cache
rm -rf "$TRITON_CACHE_DIR" "$DISTMK_CACHE_DIR"
for run in cold warm; do
  t0=$(date +%s.%N)
  python3 -m distmk.generate --model llama-3-8b --prompt-ids 1,2,3 --max-new-tokens 1 --backend triton \
      --device cuda --json > /tmp/startup_$run.json 2>/dev/null
  t1=$(date +%s.%N)
  echo "{\"run\": \"$run\", \"process_to_first_token_s\": $(python3 -c "print(round($t1 - $t0, 2))"), \"generate\": $(cat /tmp/startup_$run.json)}"
done | tee "$OUT/startup_llama-3-8b.jsonl"
