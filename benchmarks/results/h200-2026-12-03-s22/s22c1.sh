# session 22, call 1 (bash .scratch/s22c1.sh, ~550 s): fused_route and ring_stack_k (both default 0 on main, never run on
# a GPU) timed against the default ring step, logits against the tl kernel's; then their GPU tests (ring against tl)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
D=${DEADLINE:-585}
cd benchmarks
var() {  # model batch variants timeout
  [ $((SECONDS + $4)) -gt $D ] && { echo "== skip $1 b$2 ($SECONDS s)"; return; }
  echo "== $1 b$2 ($SECONDS s)"
  PYTHONPATH=.. timeout $4 python variants.py --model $1 --batch $2 --engine-kernel tl --iters 100 --variants "$3" 2>&1 | grep -v "Warn\|warn" | grep "ms,\|FAIL\|^  [a-z_]* .*[0-9]$\|layer period\|Error\|rel" | grep -v "tasks  run"
}
R='{"kernel":"ring"}'
FR='{"kernel":"ring","graph":{"fused_route":1}}'
SK='{"kernel":"ring","ring_stack_k":1}'
SK4='{"kernel":"ring","ring_stack_k":1,"ring_inputs":5}'
SK8='{"kernel":"ring","ring_stack_k":1,"ring_inputs":8}'
BOTH='{"kernel":"ring","ring_stack_k":1,"ring_inputs":5,"graph":{"fused_route":1}}'
var qwen3-30b-a3b 1 "[$R,$FR,$SK,$SK4,$SK8,$BOTH,$R,$FR,$SK,$SK4,$SK8,$BOTH,{\"kernel\":\"ring\",\"ring_stack_k\":1,\"ring_inputs\":5,\"graph\":{\"fused_route\":1},\"trace\":true}]" 190
var qwen3-8b 1 "[$R,$SK,$SK4,$R,$SK,$SK4,{\"kernel\":\"ring\",\"ring_stack_k\":1,\"trace\":true}]" 110
var llama-3-8b 1 "[$R,$SK,$SK4,$R,$SK,$SK4]" 100
var llama-3-8b 8 "[$R,$SK,$R,$SK]" 80
cd ..
echo "== gpu tests ($SECONDS s)"
timeout $((D - SECONDS)) python -m pytest -q tests/test_gpu.py -k "matches_tl_megakernel" -p no:cacheprovider --tb=line 2>&1 | grep -v "Warn\|warn(" | grep -v "^  \|^$\|Docs:\|warnings summary" | tail -16
echo "== done ($SECONDS s)"
