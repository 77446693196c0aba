#!/bin/bash
# eleventh session, call 4 (~590 s): variants pick the tree, then the four MoE decode JSONs and the MoE GPU tests on it.
#   main     b4ff90b (route shares summed without a barrier between chunks)
#   ni-all   9268cc9 = main + the tl task functions that hold tiles noinline (.scratch/ni-all)
#   ni-bt32  6db679f = ni-all + attention blocks of 32 keys (.scratch/ni-bt32)
# Choice: the ni tree with the least b1 + b8/8 (ms per token at both batches), unless main's b1 is faster still.
# Run: OUT=$OUT bash .scratch/s11c4.sh   (carry [".scratch"])
export PYTHONUNBUFFERED=1
T0=$(date +%s)
P='"prefetch_kb": 64, "prefetch_tasks": "o_proj", "mlp_block_n": 32, "lm_block_n": 64'
declare -A MS
time_tree() {   # time_tree TREE BATCH VARIANTS: mean ms of the variants
  local pp=$PWD; [ $1 != main ] && pp=$PWD/.scratch/$1:$PWD
  PYTHONPATH=$pp timeout 60 python .scratch/variants.py qwen3-30b-a3b $2 "$3" 2>&1 | grep -v -i warn | cut -c1-300 > /tmp/v_$1_$2.log
  sed "s/^/[$1] /" /tmp/v_$1_$2.log | tee -a $OUT/variants.log >&2
  grep -oE ': [0-9.]+ ms' /tmp/v_$1_$2.log | awk '{s+=$2; n++} END {if (n) printf "%.4f", s/n; else print 99}'
}
for t in main ni-all ni-bt32; do MS[$t,1]=$(time_tree $t 1 "[{$P}, {$P}]"); done
for t in ni-all ni-bt32; do MS[$t,8]=$(time_tree $t 8 "[{$P}]"); done
CHOICE=$(python3 -c "
m = {'main': (${MS[main,1]}, None), 'ni-all': (${MS[ni-all,1]}, ${MS[ni-all,8]}), 'ni-bt32': (${MS[ni-bt32,1]}, ${MS[ni-bt32,8]})}
ni = min(('ni-all', 'ni-bt32'), key=lambda t: m[t][0] + m[t][1] / 8)
print('main' if m['main'][0] < m[ni][0] - 0.01 else ni)")
declare -A COMMIT=([main]=b4ff90b [ni-all]=9268cc9 [ni-bt32]=6db679f)
echo "b1: main ${MS[main,1]} ni-all ${MS[ni-all,1]} ni-bt32 ${MS[ni-bt32,1]}; b8: ni-all ${MS[ni-all,8]} ni-bt32 ${MS[ni-bt32,8]} -> $CHOICE (${COMMIT[$CHOICE]}) after $(( $(date +%s) - T0 )) s" | tee $OUT/choice.txt
PP=""; [ $CHOICE != main ] && PP=$PWD/.scratch/$CHOICE
PYTHONPATH=$PP DISTMK_COMMIT=${COMMIT[$CHOICE]} BUDGET_S=$(( 578 - ($(date +%s) - T0) )) \
TESTS_K="(float32_tokens or bfloat16_matches) and (moe or mixtral)" \
PARTS="decode_qwen_b1 decode_qwen_b8 decode_mixtral_b1 decode_mixtral_b8 tests_tiny logits_30b" \
COMPILE_MODE_B1=default COMPILE_MODE_B8=default DECODE_EXTRA="--prefetch-kb 64 --prefetch-tasks o_proj --mlp-block-n 32 --lm-block-n 64" \
bash .scratch/moe_gpu.sh 2>&1 | cut -c1-700 | tail -30
