# session 22, MoE decode JSONs on the ring kernel (COMMIT=<hash> RUNS="model batch,..." bash s22c2.sh), one after
# another in one call; qwen3-30b-a3b's compiled baseline takes up to ~250 s on a cold inductor cache
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd benchmarks
IFS=, read -ra runs <<< "${RUNS:-qwen3-30b-a3b 1,qwen3-30b-a3b 8}"
for mb in "${runs[@]}"; do
  set -- $mb; left=$((${DEADLINE:-590} - SECONDS)); [ $left -lt 100 ] && { echo "== skip $1 b$2"; continue; }
  echo "== $1 b$2 ($SECONDS s)"
  DISTMK_COMMIT=$COMMIT PYTHONPATH=.. timeout $((left < 300 ? left : 300)) python decode.py --model $1 --batch $2 --context 512 --iters 100 --skip-hf --compile-baseline --kernel ring --json --out $OUT/decode_ring_$1_b$2_tp1.json > $OUT/full.log 2>&1
  grep -v "Warning\|warn(" $OUT/full.log | tail -25 > $OUT/decode_ring_$1_b$2_tp1.log; rm $OUT/full.log
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('step_ms','cudagraph_compiled_ms','speedup_vs_compiled','efficiency')})" $OUT/decode_ring_$1_b$2_tp1.json
done
echo "== done ($SECONDS s)"
