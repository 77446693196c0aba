#!/usr/bin/env bash
# Load benchmark of distmk.serve on GPUs: start the server (tp ranks under torchrun, or one process for
# tp=1), wait until it answers (at most 4 minutes), run serve_load.py against it, stop the server with SIGTERM
# (then kill whatever is left below it: torchrun's ranks run in sessions of their own).
# LOAD=matrix: --max-context ${MAX_CONTEXT:-4096} and serve_load.py --matrix $MATRIX_ARGS (default: 1 and 8
# streams x 256- and 2000-token prompts, 128 tokens out, 8 requests per stream) into serve_matrix_MODEL_tpTP.json
# and .png, the server's step timeline (--trace-steps) into steps_MODEL_tpTP.jsonl and step_trace.py's summary
# of it per cell into serve_matrix_MODEL_tpTP_steps.json; else 64 requests, 8 at once, 256-token prompts into
# serve_load_MODEL_tpTP.json. LOAD=features: serve_load.py --features $FEATURES_ARGS (default: 8 requests a cell, 128
# tokens out, 2000-token prompts) into serve_features_MODEL_tpTP.json.
# SERVE_ARGS: more flags for the server (e.g. --kv-splits 16).
# Usage, from the repository root: OUT=dir [LOAD=matrix] bash benchmarks/run_serve_gpu.sh TP [MODEL]
# (BACKEND=reference DEVICE=cpu runs the same on the CPU, for a tiny preset)
set -u
source "$(dirname "$0")/../launch/env.sh"
tp=${1:?usage: run_serve_gpu.sh TP [MODEL]} model=${2:-llama-3-8b} port=${PORT:-8300}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
log="$OUT/serve_${model}_tp${tp}.log"
if [ "${LOAD:-single}" = matrix ]; then
  max_context=${MAX_CONTEXT:-4096} result="$OUT/serve_matrix_${model}_tp${tp}.json"
  load=(--matrix ${MATRIX_ARGS:---streams 1,8 --prompt-lens 256,2000 --rounds 8 --max-tokens 128})
  steps="$OUT/steps_${model}_tp${tp}.jsonl"       # the server's step timeline, summarised per cell at the end
elif [ "${LOAD:-single}" = features ]; then
  max_context=${MAX_CONTEXT:-4096} result="$OUT/serve_features_${model}_tp${tp}.json"
  load=(--features ${FEATURES_ARGS:---rounds 8 --max-tokens 128 --prompt-lens 2000})
else
  max_context=1024 result="$OUT/serve_load_${model}_tp${tp}.json"
  load=(--concurrency 8 --requests 64 --max-tokens 128 --prompt-len 256)
fi
args=(-m distmk.serve --model "$model" --backend "${BACKEND:-triton}" --device "${DEVICE:-cuda}" --max-batch 16 --max-context "$max_context" --port "$port" ${steps:+--trace-steps "$steps"} ${SERVE_ARGS:-})
if [ "$tp" -gt 1 ]; then
  setsid "$DISTMK_PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$tp" "${args[@]}" > "$log" 2>&1 &
else
  setsid "$DISTMK_PYTHON" "${args[@]}" > "$log" 2>&1 &
fi
server=$!
below() { local p; for p in $(ps -o pid= --ppid "$1" 2> /dev/null); do below "$p"; echo "$p"; done; }
stop() {
  local pids
  pids="$(below "$server")"
  kill -TERM "$server" 2> /dev/null
  for _ in $(seq 30); do kill -0 "$server" 2> /dev/null || break; sleep 1; done
  kill -KILL "$server" $pids $(below "$server") 2> /dev/null
}
trap stop EXIT
trap 'exit 143' TERM INT
# healthy and answering a completion (slurm/check_serve.py, which serve.sbatch uses too)
if ! "$DISTMK_PYTHON" slurm/check_serve.py --url "http://127.0.0.1:$port" --model "$model" --timeout 240 \
    --server-pid "$server" > /dev/null; then
  echo "server did not come up; see $log" >&2
  tail -n 20 "$log" >&2
  exit 1
fi
# --foreground: in this script's process group, so that a timeout around the script stops the load too
timeout --foreground 240 "$DISTMK_PYTHON" benchmarks/serve_load.py --url "http://127.0.0.1:$port" "${load[@]}" --out "$result" \
    > /dev/null
load_rc=$?                # a run with failed requests still writes its JSON: annotated below, then the exit code
[ -s "$result" ] || exit 1
PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" "$DISTMK_PYTHON" - "$result" "$tp" "$model" "${args[*]}" <<'PY'
import datetime, json, os, sys, torch, triton
from decode import git_commit
out, tp, model, server = sys.argv[1:]
r = json.load(open(out))
r.update(model=model, tp=int(tp), gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__,
         triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         backend=os.environ.get("BACKEND", "triton"), server=f"python {server}", load_command=r.get("command"),
         command=f"LOAD={os.environ.get('LOAD', 'single')} benchmarks/run_serve_gpu.sh {tp} {model}",
         distmk_commit=git_commit())
json.dump(r, open(out, "w"), indent=1)
print(json.dumps(r))
PY
if [ -n "${steps:-}" ]; then     # the server writes its timeline out as it stops
  stop
  "$DISTMK_PYTHON" benchmarks/step_trace.py "$steps" --matrix "$result" --json "${result%.json}_steps.json"
fi
exit $load_rc
