"""benchmarks/scaling.py on the CPU: an interrupted sweep keeps the runs it finished, and --resume measures
only the rest."""
import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO

SWEEP = [sys.executable, "benchmarks/scaling.py", "--backend", "reference", "--device", "cpu", "--models",
         "tiny-llama", "--tp", "1,2", "--context", "32", "--iters", "3", "--skip-hf"]


def records(out_dir) -> list[dict]:
    path = out_dir / "scaling.json"
    return json.loads(path.read_text()) if path.exists() else []


def test_interrupted_sweep_keeps_its_runs_and_resumes(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    sweep = subprocess.Popen([*SWEEP, "--out-dir", str(tmp_path)], cwd=REPO, env=env, start_new_session=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not records(tmp_path) and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(sweep.pid, signal.SIGINT)                   # Ctrl-C, while tp=2 runs
    output = sweep.communicate(timeout=60)[0]
    assert sweep.returncode == 130, output[-3000:]
    (first,) = records(tmp_path)
    assert first["tp"] == 1 and first["step_ms"] > 0 and first["hf_eager_ms"] is None
    assert "| tiny-llama |" in (tmp_path / "summary.md").read_text()

    proc = subprocess.run([*SWEEP, "--out-dir", str(tmp_path), "--resume"], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept, second = records(tmp_path)
    assert kept == first and second["tp"] == 2 and second["step_ms"] > 0
