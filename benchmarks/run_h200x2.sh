#!/usr/bin/env bash
# One session on 2 H200s (device kind nvidia-h200-x2): tensor-parallel GPU tests, the all-reduce and overlap
# benchmarks, the tp=2 decode benchmarks; with SERVE=1 the server load benchmark at tp 1 and 2, with SCALING=1
# the tp 1-2 scaling sweep (each long: give them device calls of their own, SKIP_TP2=1 skipping the rest, e.g.
# `SKIP_TP2=1 SERVE=1`). The device image lacks nvshmem4py: carry its wheel in .whl/
# (benchmarks/README.md says how). Usage, from the repository root: OUT=dir bash benchmarks/run_h200x2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never NVLink multicast here
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
quiet() { grep -v -E "Warn|warn_once|^W[0-9]{4}|\*{10}|OMP_NUM_THREADS"; }
if [ -z "${SKIP_TP2:-}" ]; then
timeout 300 python3 -m pytest -q -s tests/test_gpu.py -k "tp2" 2>&1 | quiet | tee "$OUT/gpu_tests_tp2.log" | tail -n 8
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --out "$OUT/allreduce_tp2.json" 2>&1 \
    | quiet > "$OUT/allreduce_tp2.log"; grep -v '^\[{' "$OUT/allreduce_tp2.log" | tail -n 12
timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/overlap.py --out "$OUT/overlap_tp2.json" 2>&1 \
    | quiet > "$OUT/overlap_tp2.log"; tail -n 5 "$OUT/overlap_tp2.log"
for spec in ${MODELS:-llama-3-8b:1 qwen3-8b:1 llama-3-8b:8}; do   # COMPILE=--compile-baseline: also torch.compile
  model=${spec%:*} batch=${spec#*:}
  timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/decode.py --model "$model" --batch "$batch" \
      --context 512 --iters 100 --json --skip-hf ${COMPILE:-} --out "$OUT/decode_${model}_b${batch}_tp2.json" 2>&1 \
      | quiet > "$OUT/decode_${model}_b${batch}_tp2.log"
  grep -E "^\[decode\] (distmk|step span)|^  [a-z]" "$OUT/decode_${model}_b${batch}_tp2.log" | head -n 14
done
fi
if [ -n "${SERVE:-}" ]; then      # issue 5's load benchmark, one 8B preset at tp=1 and tp=2
  for tp in 1 2; do timeout 290 bash benchmarks/run_serve_gpu.sh "$tp" llama-3-8b | tail -c 400; done
fi
if [ -n "${SCALING:-}" ]; then
  # the scaling study (issue 6): tp 1 and 2 over the model-size sweep, figures and summary.md in $OUT/scaling
  timeout 560 python3 benchmarks/scaling.py --models qwen3-0.6b,llama-3.2-1b,llama-3-8b,qwen3-8b --tp 1,2 \
      --context 512 --iters 100 --skip-hf --run-timeout 240 --out-dir "$OUT/scaling" 2>&1 | grep -v "scaling:" | tail -n 12
fi
python3 - "$OUT" <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/decode_*_tp2.json")):
    r = json.load(open(path))
    print(f"{r['model']:<11} tp2 b{r['batch']}: step {r['step_ms']:.3f} ms  roofline {r['roofline_ms']:.3f}  eff "
          f"{r['efficiency']:.2f}  graph {r['cudagraph_ms']:.2f}  compiled {r['cudagraph_compiled_ms']}  "
          f"x{r['speedup_vs_cudagraph']:.2f}  allreduce {r['allreduce_us']:.1f} us  peer wait {r['peer_wait_fraction']:.3f}")
PY
