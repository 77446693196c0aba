#!/usr/bin/env bash
# One session on 2 H200s (device kind nvidia-h200-x2): tensor-parallel tests, the tp=2 decode benchmark and
# the tp 1-2 scaling sweep (figures need matplotlib; without it, scaling.py --resume draws them later).
# The device image lacks nvshmem4py: carry its wheel in .whl/ (benchmarks/README.md says how).
# Usage, from the repository root: OUT=dir bash benchmarks/run_h200x2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never NVLink multicast here
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
timeout 300 python3 -m pytest -q -s tests/test_gpu.py -k "tp2" 2>&1 | grep -v Warn | tee "$OUT/gpu_tests_tp2.log" | tail -n 6
for model in llama-3-8b qwen3-8b; do
  timeout 150 torchrun --standalone --nproc-per-node 2 benchmarks/decode.py --model "$model" --batch 1 \
      --context 512 --iters 100 --json --skip-hf --out "$OUT/decode_${model}_b1_tp2.json" 2>/dev/null | tail -c 600
done
# the scaling study (issue 6): tp 1 and 2 over the model-size sweep, figures and summary.md in $OUT/scaling
timeout 1200 python3 benchmarks/scaling.py --models qwen3-0.6b,llama-3.2-1b,llama-3-8b,qwen3-8b --tp 1,2 \
    --context 512 --iters 100 --skip-hf --run-timeout 240 --out-dir "$OUT/scaling" 2>&1 | grep -v "scaling:" | tail -n 12
