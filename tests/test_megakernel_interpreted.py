"""The megakernel's Triton code run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), checked
against the reference executor, so CI catches kernel regressions without a GPU. One worker: the
interpreter runs programs one after another, so only a single queue can make progress."""
import json
import os
import subprocess
import sys

from conftest import REPO, TINY
from test_gpu import run_watchdog_script

INTERPRETED = {**os.environ, "TRITON_INTERPRET": "1"}

SCRIPT = """
import json, sys
from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine
config = GraphConfig(batch=4, kv_splits=3, tile_rows=32, lm_tile_rows=48, workers=1)
for name in sys.argv[1:]:
    runs = [Engine(name, backend=b, config=config).generate([1, 2, 3, 4, 5, 6, 7], 5, return_logits=True)
            for b in ("reference", "triton")]
    (ref_tokens, ref_logits), (tokens, logits) = runs
    err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
    print(json.dumps({"model": name, "equal": tokens == ref_tokens, "rel_err": err}))
"""


def test_interpreted_megakernel_matches_reference():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *TINY], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env=INTERPRETED)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["model"] for r in results] == TINY
    for r in results:
        assert r["equal"] and r["rel_err"] < 1e-4, r


def test_interpreted_watchdog_fires():
    run_watchdog_script("cpu", 1, env=INTERPRETED)
