"""Rank, world, local rank and node count from torchrun, Open MPI and SLURM environments."""
import pytest

from distmk.dist import LaunchEnv, detect_launch, slurm_tasks_per_node
from distmk.errors import DistmkError

SRUN_TASK = {"SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
             "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_NTASKS": "8"}


@pytest.mark.parametrize("env, expected", [
    ({}, LaunchEnv("single", 0, 1, 0, 1, 1)),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"},
     LaunchEnv("torchrun", 3, 8, 3, 4, 2)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, LaunchEnv("openmpi", 5, 8, 1, 4, 2)),
    # an srun task: the step's tasks (7), not the job's (8); 3 of them on the second node
    (SRUN_TASK, LaunchEnv("slurm", 5, 7, 1, 3, 2)),
    # a batch script outside srun sees SLURM_PROCID and the job's SLURM_NTASKS, but runs alone
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "1"},
     LaunchEnv("single", 0, 1, 0, 1, 1)),
    # torchrun inside a SLURM allocation: torchrun's own variables win
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", **SRUN_TASK}, LaunchEnv("torchrun", 1, 2, 1, 2, 1)),
])
def test_detect_launch(env, expected):
    assert detect_launch(env) == expected


def test_slurm_tasks_per_node():
    assert slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_tasks_per_node("8") == [8]


@pytest.mark.parametrize("env, message", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "inconsistent torchrun environment"),
    ({**SRUN_TASK, "SLURM_LOCALID": "3"}, "inconsistent slurm environment"),   # node 1 runs 3 tasks
    ({k: v for k, v in SRUN_TASK.items() if k != "SLURM_NODEID"}, "SLURM_NODEID is not set"),
])
def test_bad_launcher_environment(env, message):
    with pytest.raises(DistmkError, match=message):
        detect_launch(env)
