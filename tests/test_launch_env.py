"""Rank, world, local rank and node count from torchrun, Open MPI and SLURM environments."""
import pytest

from distmk.dist import LaunchEnv, detect_launch
from distmk.errors import DistmkError


@pytest.mark.parametrize("env, expected", [
    ({}, LaunchEnv("single", 0, 1, 0, 1, 1)),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"},
     LaunchEnv("torchrun", 3, 8, 3, 4, 2)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, LaunchEnv("openmpi", 5, 8, 1, 4, 2)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NNODES": "4"},
     LaunchEnv("slurm", 2, 4, 0, 1, 4)),
    # torchrun inside a SLURM allocation: torchrun's own variables win
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
      "SLURM_LOCALID": "0"}, LaunchEnv("torchrun", 1, 2, 1, 2, 1)),
])
def test_detect_launch(env, expected):
    assert detect_launch(env) == expected


@pytest.mark.parametrize("env, message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "inconsistent torchrun environment"),
])
def test_bad_launcher_environment(env, message):
    with pytest.raises(DistmkError, match=message):
        detect_launch(env)
