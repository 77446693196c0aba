nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd benchmarks
echo "== bloat qwen3-8b ($SECONDS s)"
A='"qkv,attention,attn_reduce,o_proj,gate_up,down"'
PYTHONPATH=../.scratch/bloat:. timeout 150 python ../.scratch/variants_env.py --model qwen3-8b --batch 1 --engine-kernel ring --iters 100 --variants "[{\"kernel\":\"ring\"},{\"kernel\":\"ring\",\"env\":{\"DISTMK_BLOAT\":$A}},{\"kernel\":\"ring\",\"env\":{\"DISTMK_BLOAT\":\"\"}},{\"kernel\":\"ring\",\"env\":{\"DISTMK_BLOAT\":$A}},{\"kernel\":\"ring\",\"trace\":true,\"env\":{\"DISTMK_BLOAT\":\"\"}},{\"kernel\":\"ring\",\"trace\":true,\"env\":{\"DISTMK_BLOAT\":$A}}]" 2>&1 | grep -v "Warn\|warn" | grep "ms,\|FAIL\|^  [a-z_]* .*[0-9]$\|layer period" | grep -v "tasks  run"
for tree in h18 n18; do ek=ring; [ $tree = n18 ] && ek=tl
echo "== $tree 30b ($SECONDS s)"
PYTHONPATH=../.scratch/$tree timeout 140 python variants.py --model qwen3-30b-a3b --batch 1 --engine-kernel $ek --iters 100 --variants '[{"kernel":"ring"},{"kernel":"ring"},{"kernel":"ring","trace":true}]' 2>&1 | grep -v "Warn\|warn" | grep "ms,\|FAIL\|^  [a-z_]* .*[0-9]$\|layer period" | grep -v "tasks  run" | sed "s|^|$tree |"
done
echo "== done ($SECONDS s)"
