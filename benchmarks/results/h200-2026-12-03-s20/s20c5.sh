# session 20: qwen3-30b-a3b and qwen3-8b b1 at HEAD (the wait fix + fused_attn_reduce, without mma_pair) against p19, then the GPU suite
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd benchmarks
for m in qwen3-30b-a3b qwen3-8b; do
  for t in .scratch/p19 .; do
    echo "== $t $m ($SECONDS s)"
    PYTHONPATH=../$t timeout 60 python variants.py --model $m --batch 1 --engine-kernel ring --iters 100 --variants '[{"kernel":"ring"},{"kernel":"ring"},{"kernel":"ring","trace":true}]' 2>&1 | grep -v "Warn\|warn" | grep "ms,\|FAIL\|^  [a-z_]* .*[0-9]$\|layer period\|Error" | grep -v "tasks  run"
  done
done
cd ..
echo "== gpu tests ($SECONDS s)"
timeout $((585 - SECONDS)) python -m pytest -q tests/test_gpu.py -k "not tp2" -p no:cacheprovider --tb=line > $OUT/gpu_tests.full.log 2>&1
grep -v "Warning\|warn(" $OUT/gpu_tests.full.log | grep -v "^  \|^$\|Docs:\|warnings summary" | tail -30 > $OUT/gpu_tests.log; cat $OUT/gpu_tests.log
echo "== done ($SECONDS s)"
