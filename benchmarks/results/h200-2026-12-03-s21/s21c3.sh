# session 21, call 3 (COMMIT=<hash> bash .scratch/s21c3.sh): issue 17's MoE decode JSONs on the ring kernel, qwen3-30b-a3b and mixtral-8x7b, b1 and b8
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd benchmarks
for mb in "qwen3-30b-a3b 1" "mixtral-8x7b 1" "qwen3-30b-a3b 8" "mixtral-8x7b 8"; do
  set -- $mb; left=$((590 - SECONDS)); [ $left -lt 100 ] && break
  echo "== $1 b$2 ($SECONDS s)"
  DISTMK_COMMIT=$COMMIT PYTHONPATH=.. timeout $((left < 160 ? left : 160)) python decode.py --model $1 --batch $2 --context 512 --iters 100 --skip-hf --compile-baseline --kernel ring --json --out $OUT/decode_ring_$1_b$2_tp1.json > $OUT/full.log 2>&1
  grep -v "Warning\|warn(" $OUT/full.log | tail -25 > $OUT/decode_ring_$1_b$2_tp1.log; rm $OUT/full.log
  python -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d.get(k) for k in ('step_ms','cudagraph_compiled_ms','speedup_vs_compiled','efficiency')})" $OUT/decode_ring_$1_b$2_tp1.json
done
echo "== done ($SECONDS s)"
