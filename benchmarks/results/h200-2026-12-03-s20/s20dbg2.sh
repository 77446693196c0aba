# bisect the ring-vs-tl failure: HEAD without mma_pair (nm20), HEAD without the wait change (nw20)
T="tests/test_gpu.py::test_ring_megakernel_matches_tl_megakernel"
for t in nm20 nw20; do
  echo "== $t ($SECONDS s)"
  (cd .scratch/$t && timeout 150 python -m pytest -q --tb=line -p no:cacheprovider -c /dev/null --rootdir . "../../$T" ../../tests/test_gpu.py::test_watchdog_reports_the_stuck_task_and_nothing_hangs ../../tests/test_gpu.py::test_ring_watchdog_reports_the_stuck_task_and_nothing_hangs 2>&1 | grep "passed\|failed\|Error\|assert" | head -14)
done
echo "== done ($SECONDS s)"
