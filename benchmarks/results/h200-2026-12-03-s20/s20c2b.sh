# session 20, call 1 (bash .scratch/s20c2b.sh): trees p19 (= main's kernel) and wf20 (fuse-attn-reduce branch + mma_pair +
# the one-round-trip event wait: 6479bf1 + 5a0bd70 + e059f98 on branch wf20), b1 of qwen3-30b-a3b and qwen3-8b, traced;
# then dense batch 8 at 2 attention keys on wf20
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
D=${DEADLINE:-500}
cd benchmarks
var() {  # tree model batch variants timeout
  [ $((SECONDS + $5)) -gt $D ] && { echo "== skip $1 $2 b$3 ($SECONDS s)"; return; }
  echo "== $1 $2 b$3 ($SECONDS s)"
  PYTHONPATH=../.scratch/$1 timeout $5 python variants.py --model $2 --batch $3 --engine-kernel ring --iters 100 --variants "$4" 2>&1 | grep -v "Warn\|warn" | grep "ms,\|FAIL\|^  [a-z_]* .*[0-9]$\|layer period\|Error" | grep -v "tasks  run" | sed "s|^|$1 |"
}
F='{"kernel":"ring","graph":{"fused_attn_reduce":1}}'
for m in qwen3-30b-a3b qwen3-8b; do
  var p19 $m 1 '[{"kernel":"ring"},{"kernel":"ring"},{"kernel":"ring","trace":true}]' 75
  var wf20 $m 1 "[{\"kernel\":\"ring\"},$F,{\"kernel\":\"ring\"},$F,{\"kernel\":\"ring\",\"graph\":{\"fused_attn_reduce\":1},\"trace\":true}]" 95
done
for m in llama-3-8b qwen3-8b; do
  var wf20 $m 8 '[{"kernel":"ring"},{"kernel":"ring","ring_attention_keys":2},{"kernel":"ring"},{"kernel":"ring","ring_attention_keys":2}]' 75
done
echo "== done ($SECONDS s)"
