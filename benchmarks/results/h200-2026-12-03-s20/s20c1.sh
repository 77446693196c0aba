# next session, call 1 (COMMIT=<hash> bash .scratch/s20c1.sh): the full GPU suite "not tp2" alone (~300-330 s; 290 s was too short in s19)
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
echo "== gpu tests ($SECONDS s) at $COMMIT"
timeout 500 python -m pytest -q tests/test_gpu.py -k "not tp2" -p no:cacheprovider --durations=8 > $OUT/gpu_tests.full.log 2>&1
grep -v "Warning\|warn(" $OUT/gpu_tests.full.log | grep -v "^  \|^$\|Docs:\|warnings summary" | tail -14 > $OUT/gpu_tests.log; rm $OUT/gpu_tests.full.log; cat $OUT/gpu_tests.log
echo "== done ($SECONDS s)"
