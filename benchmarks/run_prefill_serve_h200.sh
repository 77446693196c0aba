#!/usr/bin/env bash
# One H200, about 7 minutes, one device call (the last run gets what is left of DEADLINE, default 580 s): prefill.py
# (chunks of 256, 512, 2048 tokens against the bf16 tensor-core roofline and the torch.compile'd PyTorch prefill;
# then the 64-token suffix of a cached 2000-token prefix as the server runs it, its prompt's last chunk in the
# server's bucket of keys), then distmk.serve for MODEL (--max-batch 16 --max-context 4096, plus SERVE_ARGS) and
# serve_load.py's matrix against it (LOAD=matrix run_serve_gpu.sh), then a server again for serve_load.py --features
# (LOAD=features: a JSON schema's inter-token latency, a 2000-token prompt's log-probabilities' time), their ratios
# and the cells' TTFT printed last with the server's split of it (step_trace.py).
# Everything goes to OUT_DIR. The device image lacks the HTTP stack: carry its wheels in .whl/ (benchmarks/README.md
# says how); they are installed if there. PREFILL_ARGS: more prefill.py flags.
# Usage, from the repository root: bash benchmarks/run_prefill_serve_h200.sh OUT_DIR [MODEL]
# (on the device machine, DISTMK_COMMIT=<hash> too: its checkout's git HEAD is not the tree it was sent)
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
timeout 60 "$DISTMK_PYTHON" benchmarks/prefill.py --model "$model" --chunks 64 --start 2000 --max-context 4096 --last \
    --baseline none --json --out "$out/prefill_${model}_cached_suffix.json" > /dev/null \
    2> "$out/prefill_${model}_cached_suffix.log"
grep "tokens " "$out/prefill_${model}_cached_suffix.log"
stamp "distmk.serve $model, serve_load.py --matrix"
OUT=$out LOAD=matrix timeout 330 bash benchmarks/run_serve_gpu.sh 1 "$model" > /dev/null
echo "serve matrix: exit $?"
left=$((${DEADLINE:-580} - SECONDS))       # what the device call has left
if [ $left -ge 90 ]; then
  stamp "distmk.serve $model, serve_load.py --features"
  OUT=$out LOAD=features timeout $((left < 200 ? left : 200)) bash benchmarks/run_serve_gpu.sh 1 "$model" > /dev/null
  echo "serve features: exit $?"
else
  stamp "serve features skipped: $left s left"
fi
"$DISTMK_PYTHON" - "$out/serve_matrix_${model}_tp1.json" "$out/serve_matrix_${model}_tp1_steps.json" \
    "$out/serve_features_${model}_tp1.json" <<'PY'
import json, sys
sys.path.insert(0, "benchmarks")
from step_trace import FIRST_PARTS
try:
    for f in json.load(open(sys.argv[3]))["features"]:
        key = f["compared"]
        print(f"{f['feature']}: {key[:-2]} p50 {f['with'][key]['p50'] * 1e3:.2f} ms against "
              f"{f['plain'][key]['p50'] * 1e3:.2f} without, {f['ratio_p50']}x")
except (OSError, ValueError, KeyError, TypeError) as e:
    print(f"serve features: no result ({e!r})")
cells = json.load(open(sys.argv[1]))["cells"]
try:
    traced = json.load(open(sys.argv[2]))["cells"]
except (OSError, ValueError, KeyError):
    traced = [{}] * len(cells)
for c, t in zip(cells, traced):
    server, first = c.get("server") or {}, t.get("first_token") or {}
    print(f"{c['concurrency']} streams, {c['prompt_len']} tokens ({c['cached_tokens_mean']} cached): TTFT p50 "
          f"{c['ttft_s']['p50'] * 1e3:.1f} ms (server {server.get('ttft_ms_mean')}, prefill chunk "
          f"{server.get('prefill_ms_mean')} ms), inter-token p50 {c['itl_s']['p50'] * 1e3:.2f} ms, {c['failed']} failed")
    print("    to the first token's hand-over, p50 ms: " + ", ".join(
        f"{part} {first.get(part + '_ms_p50')}" for part in FIRST_PARTS))
PY
stamp done
