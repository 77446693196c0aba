# next session, call 1 (COMMIT=<hash> bash .scratch/s19c1.sh): full GPU tests, then qwen3-30b-a3b decode b1 and b8 against the compiled graph (~520 s)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== gpu tests ($SECONDS s)"
timeout 290 python -m pytest -q tests/test_gpu.py -k "not tp2" -p no:cacheprovider --durations=8 > $OUT/gpu_tests.full.log 2>&1
grep -v "Warning\|warn(" $OUT/gpu_tests.full.log | tail -14 > $OUT/gpu_tests.log; rm $OUT/gpu_tests.full.log; cat $OUT/gpu_tests.log
cd benchmarks
for b in 1 8; do
left=$((585 - SECONDS)); [ $left -lt 110 ] && break
echo "== decode b$b ($SECONDS s, $left left)"
DISTMK_COMMIT=$COMMIT PYTHONPATH=.. timeout $left python decode.py --model qwen3-30b-a3b --batch $b --context 512 --iters 50 --skip-hf --compile-baseline --kernel ring --compile-mode default --json --out $OUT/decode_ring_qwen3-30b-a3b_b${b}_tp1.json > $OUT/full_b$b.log 2>&1
grep -v "Warning\|warn(" $OUT/full_b$b.log | tail -40 > $OUT/decode_ring_qwen3-30b-a3b_b${b}_tp1.log; rm $OUT/full_b$b.log
grep "phase timeline" -A 14 $OUT/decode_ring_qwen3-30b-a3b_b${b}_tp1.log; grep "^\[decode\]" $OUT/decode_ring_qwen3-30b-a3b_b${b}_tp1.log | cut -c1-250
done
echo "== done ($SECONDS s)"
