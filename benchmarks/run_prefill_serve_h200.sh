#!/usr/bin/env bash
# One H200, about 5 minutes (at most 9.5 by the timeouts, so one device call): prefill.py (chunks of 256, 512,
# 2048 tokens against the bf16 tensor-core roofline and the torch.compile'd PyTorch prefill), then distmk.serve
# for MODEL (--max-batch 16 --max-context 4096, plus SERVE_ARGS) and serve_load.py's matrix against it (LOAD=matrix
# run_serve_gpu.sh). Everything goes to OUT_DIR. The device image lacks the HTTP stack: carry its wheels in .whl/
# (benchmarks/README.md says how); they are installed if there. PREFILL_ARGS: more prefill.py flags.
# Usage, from the repository root: bash benchmarks/run_prefill_serve_h200.sh OUT_DIR [MODEL]
set -u
out=${1:?usage: run_prefill_serve_h200.sh OUT_DIR [MODEL]} model=${2:-llama-3-8b}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DISTMK_PYTHON=${DISTMK_PYTHON:-python3}
stamp() { echo "[$(date +%T)] $*"; }

stamp "prefill.py $model"
timeout 240 "$DISTMK_PYTHON" benchmarks/prefill.py --model "$model" ${PREFILL_ARGS:-} --json \
    --out "$out/prefill_$model.json" > /dev/null 2> "$out/prefill_$model.log"
echo "prefill.py: exit $?"
grep "tokens " "$out/prefill_$model.log"
stamp "distmk.serve $model, serve_load.py --matrix"
OUT=$out LOAD=matrix timeout 330 bash benchmarks/run_serve_gpu.sh 1 "$model" > /dev/null
echo "serve matrix: exit $?"
stamp done
