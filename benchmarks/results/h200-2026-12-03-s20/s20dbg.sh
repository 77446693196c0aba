# which change broke the GPU tests: the failing tests' messages at HEAD, then one ring-vs-tl test per tree
nvidia-smi --query-gpu=name --format=csv,noheader
T="tests/test_gpu.py::test_ring_megakernel_matches_tl_megakernel[tiny-qwen2-1-0]"
echo "== HEAD ($SECONDS s)"
timeout 150 python -m pytest -q -x --tb=short -p no:cacheprovider "$T" tests/test_gpu.py::test_watchdog_reports_the_stuck_task_and_nothing_hangs 2>&1 | grep -v "Warn\|warn\|^$" | grep -v "^  warnings" | head -60
for t in p19 m19 w19 f19; do
  [ $SECONDS -gt 420 ] && break
  echo "== $t ($SECONDS s)"
  (cd .scratch/$t && timeout 60 python -m pytest -q -x --tb=line -p no:cacheprovider -c /dev/null --rootdir . "../../$T" 2>&1 | grep "passed\|failed\|Error\|assert" | head -5)
done
echo "== done ($SECONDS s)"
