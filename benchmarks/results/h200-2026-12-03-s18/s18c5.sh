# priority order, each step only if it fits before DEADLINE (seconds of this script)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
D=${DEADLINE:-250}
cd benchmarks
var() {  # tree model engine-kernel variants timeout
  [ $((SECONDS + $5)) -gt $D ] && { echo "== skip $1 $2 ($SECONDS s)"; return; }
  echo "== $1 $2 engine $3 ($SECONDS s)"
  PYTHONPATH=../.scratch/$1 timeout $5 python variants.py --model $2 --batch 1 --engine-kernel $3 --iters 100 --variants "$4" 2>&1 | grep -v "Warn\|warn" | grep "ms,\|FAIL\|^  [a-z_]* .*[0-9]$\|layer period\|Error" | grep -v "tasks  run" | sed "s|^|$1 |"
}
R2='[{"kernel":"ring"},{"kernel":"ring"}]'
R2T='[{"kernel":"ring"},{"kernel":"ring"},{"kernel":"ring","trace":true}]'
var n18b qwen3-8b tl "$R2T" 70
var h18 qwen3-8b ring "$R2T" 50
cd ..
if [ $((SECONDS + 70)) -le $D ]; then echo "== gpu tests ($SECONDS s)"
timeout 70 python -m pytest -q tests/test_gpu.py -k "ring_megakernel_matches" -p no:cacheprovider > $OUT/gpu_tests_ring.full.log 2>&1
grep -v "Warning\|warn(" $OUT/gpu_tests_ring.full.log | tail -4; fi
cd benchmarks
var n18b qwen3-30b-a3b ring "$R2T" 60
var h18 qwen3-30b-a3b ring "$R2" 55
echo "== done ($SECONDS s)"
