#!/usr/bin/env bash
# Load benchmark of distmk.serve on GPUs: start the server (tp ranks under torchrun, or one process for
# tp=1), wait for /health (bounded), run serve_load.py against it, stop the server with SIGTERM.
# Usage, from the repository root: OUT=dir bash benchmarks/run_serve_gpu.sh TP [MODEL]
set -u
tp=${1:?usage: run_serve_gpu.sh TP [MODEL]} model=${2:-llama-3-8b} port=${PORT:-8300}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
log="$OUT/serve_${model}_tp${tp}.log"
args=(-m distmk.serve --model "$model" --backend triton --device cuda --max-batch 16 --max-context 1024 --port "$port")
if [ "$tp" -gt 1 ]; then
  setsid torchrun --standalone --nproc-per-node "$tp" "${args[@]}" > "$log" 2>&1 &
else
  setsid python3 "${args[@]}" > "$log" 2>&1 &
fi
server=$!
for _ in $(seq 240); do
  curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
  kill -0 "$server" 2> /dev/null || break
  sleep 1
done
if curl -sf "http://127.0.0.1:$port/health" > /dev/null; then
  timeout 240 python3 benchmarks/serve_load.py --url "http://127.0.0.1:$port" --concurrency 8 --requests 64 \
      --max-tokens 128 --prompt-len 256 > "$OUT/serve_load_${model}_tp${tp}.raw.json"
  python3 - "$OUT/serve_load_${model}_tp${tp}.raw.json" "$OUT/serve_load_${model}_tp${tp}.json" "$tp" "$model" <<'PY'
import datetime, json, sys, torch, triton
raw, out, tp, model = sys.argv[1:]
r = json.load(open(raw))
r.update(model=model, tp=int(tp), backend="triton", gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
         triton=triton.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         command=f"benchmarks/run_serve_gpu.sh {tp} {model}")
json.dump(r, open(out, "w"), indent=1)
print(json.dumps(r))
PY
  rm -f "$OUT/serve_load_${model}_tp${tp}.raw.json"
else
  echo "server did not come up; see $log" >&2; tail -n 20 "$log" >&2
fi
kill -TERM -- -"$server" 2> /dev/null
for _ in $(seq 30); do kill -0 "$server" 2> /dev/null || break; sleep 1; done
kill -KILL -- -"$server" 2> /dev/null
