#!/usr/bin/env bash
# Two H200s (device kind nvidia-h200-x2): the STAGES named, in this order ("tp1 tp2" fits one device call):
#   tp2      tensor-parallel GPU tests (TP2_TESTS=0 skips them), tp=2 decode.py for TP2_MODELS (none by
#            default; e.g. llama-3-8b:8)
#   allreduce, overlap   allreduce.py, overlap.py
#   tp1      run_h200.sh's GPU tests on GPU 0 while GPU 1 runs decode.py for TP1_MODELS (with transformers'
#            eager baseline) and then times start-up
#   serve    the server load benchmark (issue 5), one 8B preset at tp=1 and tp=2
#   scaling  the tp 1-2 scaling sweep over the model-size sweep (figures and summary.md in $OUT/scaling),
#            without transformers' baseline unless SCALING_ARGS says otherwise (the tp1 stage has it)
# A table of everything measured under $OUT comes last. The device image lacks nvshmem4py and the HTTP stack:
# carry their wheels in .whl/ (benchmarks/README.md says how). Usage, from the repository root:
#   OUT=dir STAGES="tp1 tp2" bash benchmarks/run_h200x2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never NVLink multicast here
OUT=${OUT:-benchmarks/results}
STAGES=" ${STAGES:-tp2} "
mkdir -p "$OUT"
quiet() { grep -v -E "Warn|warn_once|^W[0-9]{4}|\*{10}|OMP_NUM_THREADS"; }
stamp() { echo "[$(date +%T)] $*"; }

if [[ $STAGES == *" tp2 "* ]]; then
  if [ "${TP2_TESTS:-1}" = 1 ]; then    # TP2_TESTS=0: the decode runs alone
    stamp "GPU tests (tp=2)"
    timeout 300 python3 -m pytest -q -s tests/test_gpu.py -k "tp2" 2>&1 | quiet > "$OUT/gpu_tests_tp2.log"
    tail -n 4 "$OUT/gpu_tests_tp2.log"
  fi
  for spec in ${TP2_MODELS:-}; do       # COMPILE=--compile-baseline: also torch.compile
    model=${spec%:*} batch=${spec#*:}
    stamp "decode $model batch $batch tp=2"
    timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/decode.py --model "$model" --batch "$batch" \
        --context 512 --iters 100 --json --skip-hf ${COMPILE:-} --out "$OUT/decode_${model}_b${batch}_tp2.json" 2>&1 \
        | quiet > "$OUT/decode_${model}_b${batch}_tp2.log"
  done
fi
if [[ $STAGES == *" allreduce "* ]]; then
  stamp "allreduce.py"
  timeout 200 torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --out "$OUT/allreduce_tp2.json" 2>&1 \
      | quiet > "$OUT/allreduce_tp2.log"
fi
if [[ $STAGES == *" overlap "* ]]; then
  stamp "overlap.py"
  timeout 240 torchrun --standalone --nproc-per-node 2 benchmarks/overlap.py --out "$OUT/overlap_tp2.json" 2>&1 \
      | quiet > "$OUT/overlap_tp2.log"
fi
if [[ $STAGES == *" tp1 "* ]]; then     # GPU 0: the tests; GPU 1 meanwhile: the decode runs, then start-up times
  CUDA_VISIBLE_DEVICES=0 NO_TABLE=1 STAGES=tests bash benchmarks/run_h200.sh &
  CUDA_VISIBLE_DEVICES=1 NO_TABLE=1 STAGES="startup decode" bash benchmarks/run_h200.sh \
      ${TP1_MODELS:-llama-3-8b:1 qwen3-8b:1 llama-3-8b:8 qwen3-8b:8}
  wait
fi
if [[ $STAGES == *" serve "* ]]; then
  for tp in 1 2; do stamp "serve load tp=$tp"; timeout 290 bash benchmarks/run_serve_gpu.sh "$tp" llama-3-8b > /dev/null; done
fi
if [[ $STAGES == *" scaling "* ]]; then
  stamp "scaling sweep"
  timeout ${SCALING_TIMEOUT:-560} python3 benchmarks/scaling.py --models ${SCALING_MODELS:-llama-3-8b,qwen3-8b,llama-3.2-1b,qwen3-0.6b} \
      --tp 1,2 --context 512 --iters 100 ${SCALING_ARGS---skip-hf} --run-timeout 240 --out-dir "$OUT/scaling" 2>&1 \
      | grep -v "scaling:" > "$OUT/scaling.log"
fi
stamp done
python3 benchmarks/results_table.py "$OUT"
