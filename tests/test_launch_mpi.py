"""mpirun (Open MPI) starts the same tensor-parallel generation as torchrun: same tokens; so do the
launch/ scripts that wrap them."""
import shutil
import sys

import pytest

from conftest import hf_greedy, run_cli
from test_cli import ARGS, only_json_line

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="needs Open MPI's mpirun (Debian: openmpi-bin)")


@needs_mpirun
def test_mpirun_generate_matches_transformers():
    """Raw mpirun on 4 ranks (more ranks than cores here, hence --oversubscribe)."""
    proc = run_cli("mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4", sys.executable, "-m",
                   "distmk.generate", "--model", "tiny-llama", *ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = only_json_line(proc.stdout)
    assert out["tp"] == 4 and out["tokens"] == hf_greedy("tiny-llama")[0]


@needs_mpirun
def test_launch_scripts_start_the_same_generation():
    """launch/mpirun.sh and launch/torchrun.sh, each on 2 ranks with this interpreter: the same tokens."""
    outputs = {}
    for script in ("launch/mpirun.sh", "launch/torchrun.sh"):
        proc = run_cli("bash", script, "2", "distmk.generate", "--model", "tiny-qwen3", *ARGS,
                       env={"DISTMK_PYTHON": sys.executable})
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[script] = only_json_line(proc.stdout)
    assert {out["tp"] for out in outputs.values()} == {2}
    assert outputs["launch/mpirun.sh"]["tokens"] == outputs["launch/torchrun.sh"]["tokens"] == hf_greedy("tiny-qwen3")[0]
