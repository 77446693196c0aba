#!/usr/bin/env bash
# Load benchmark of distmk.serve on GPUs: start the server (tp ranks under torchrun, or one process for
# tp=1), wait until it answers (at most 4 minutes), run serve_load.py against it, stop the server with SIGTERM
# (then kill whatever is left below it: torchrun's ranks run in sessions of their own).
# Usage, from the repository root: OUT=dir bash benchmarks/run_serve_gpu.sh TP [MODEL]
# (BACKEND=reference DEVICE=cpu runs the same on the CPU, for a tiny preset)
set -u
source "$(dirname "$0")/../launch/env.sh"
tp=${1:?usage: run_serve_gpu.sh TP [MODEL]} model=${2:-llama-3-8b} port=${PORT:-8300}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
log="$OUT/serve_${model}_tp${tp}.log"
args=(-m distmk.serve --model "$model" --backend "${BACKEND:-triton}" --device "${DEVICE:-cuda}" --max-batch 16 --max-context 1024 --port "$port")
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
raw="$OUT/serve_load_${model}_tp${tp}.raw.json"
timeout 240 "$DISTMK_PYTHON" benchmarks/serve_load.py --url "http://127.0.0.1:$port" --concurrency 8 --requests 64 \
    --max-tokens 128 --prompt-len 256 > "$raw" || exit 1
"$DISTMK_PYTHON" - "$raw" "$OUT/serve_load_${model}_tp${tp}.json" "$tp" "$model" <<'PY'
import datetime, json, sys, torch, triton
raw, out, tp, model = sys.argv[1:]
r = json.load(open(raw))
r.update(model=model, tp=int(tp), gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch=torch.__version__,
         triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         backend=__import__("os").environ.get("BACKEND", "triton"), command=f"benchmarks/run_serve_gpu.sh {tp} {model}")
json.dump(r, open(out, "w"), indent=1)
print(json.dumps(r))
PY
rm -f "$raw"
