"""mpirun (Open MPI) starts the same tensor-parallel generation as torchrun: same tokens."""
import shutil
import sys

import pytest

from conftest import hf_greedy, run_cli
from test_cli import ARGS, only_json_line


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (Debian: openmpi-bin)")
@pytest.mark.parametrize("tp", [2, 4])
def test_mpirun_generate_matches_transformers(tp):
    proc = run_cli("mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(tp), sys.executable, "-m",
                   "distmk.generate", "--model", "tiny-llama", *ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = only_json_line(proc.stdout)
    assert out["tp"] == tp and out["tokens"] == hf_greedy("tiny-llama")[0]
