"""The megakernel's Triton code run on the CPU by Triton's interpreter (TRITON_INTERPRET=1), checked
against the reference executor, so CI catches kernel regressions without a GPU. One worker: the
interpreter runs programs one after another, so only a single queue can make progress."""
import json
import os
import subprocess
import sys

import pytest

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


# Simulated ranks are threads, each interpreting its own megakernel while the others run. Triton's
# interpreter patches triton.language around every launch and restores it afterwards, which would pull
# the rug from under the other threads: keep the patches for the life of this (test) process instead.
TENSOR_PARALLEL_SCRIPT = """
import json, sys, threading
import triton.language as tl
import triton.runtime.interpreter as interpreter
patch_lang, patched, lock = interpreter._patch_lang, set(), threading.Lock()

class KeepPatched:
    def restore(self):
        pass

def patch_once(fn):
    with lock:
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if not langs <= patched:
            patch_lang(fn)
            patched.update(langs)
    return KeepPatched()

interpreter._patch_lang = patch_once
import torch
from distmk.graph import GraphConfig
from distmk.reference.comm import run_simulated_ranks
from distmk.runtime.engine import Engine
config = GraphConfig(batch=4, kv_splits=2, tile_rows=32, lm_tile_rows=48, workers=1)
name, tp = sys.argv[1], int(sys.argv[2])
runs = {b: run_simulated_ranks(tp, lambda r, c: Engine(name, tp=tp, rank=r, comm=c, config=config, backend=b)
                               .generate([1, 2, 3, 4, 5, 6, 7], 4, return_logits=True), timeout=600)
        for b in ("reference", "triton")}
ref, tri = runs["reference"], runs["triton"]
print(json.dumps({"equal": [t[0] for t in tri] == [r[0] for r in ref],
                  "ranks_identical": all(torch.equal(t[1], tri[0][1]) for t in tri),
                  "rel_err": max(((t[1] - r[1]).abs().max() / r[1].abs().max()).item() for t, r in zip(tri, ref))}))
"""


@pytest.mark.parametrize("name, tp", [("tiny-qwen2", 2), ("tiny-llama", 4)])
def test_interpreted_tensor_parallel_megakernel(name, tp):
    """Exchanges through peers' buffers and events signalled on every rank, against the reference."""
    import triton.runtime.interpreter as interpreter
    if not hasattr(interpreter, "_patch_lang"):
        pytest.skip("this Triton's interpreter has no _patch_lang to keep patched across threads")
    proc = subprocess.run([sys.executable, "-c", TENSOR_PARALLEL_SCRIPT, name, str(tp)], cwd=REPO,
                          capture_output=True, text=True, timeout=900, env=INTERPRETED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["equal"] and result["ranks_identical"] and result["rel_err"] < 1e-4, result


def test_interpreted_watchdog_fires():
    run_watchdog_script("cpu", 1, env=INTERPRETED)
