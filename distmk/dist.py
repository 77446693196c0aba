"""Who am I in the job: rank, world, local rank and node count from whatever launched us (torchrun,
Open MPI's mpirun, SLURM's srun), and the torch.distributed process group built from it. The one place
in distmk that reads launcher environment variables."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from distmk.errors import DistmkError


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str        # "torchrun", "openmpi", "slurm" or "single"
    rank: int
    world: int
    local_rank: int
    local_world: int
    num_nodes: int


def detect_launch(env=None) -> LaunchEnv:
    env = os.environ if env is None else env

    def ints(*names):
        try:
            return [int(env[n]) for n in names]
        except KeyError as e:
            raise DistmkError(f"launcher variable {e.args[0]} is not set") from None
        except ValueError as e:
            raise DistmkError(f"launcher variable is not an integer: {e}") from None

    if "RANK" in env and "WORLD_SIZE" in env:         # torchrun (or anything speaking its protocol)
        rank, world = ints("RANK", "WORLD_SIZE")
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        launch = LaunchEnv("torchrun", rank, world, local_rank, local_world, max(1, world // local_world))
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, world, local_rank, local_world = ints("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                                    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
        launch = LaunchEnv("openmpi", rank, world, local_rank, local_world, max(1, world // local_world))
    elif "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env:
        # a task of srun; a batch script also sees SLURM_PROCID=0 and the job's SLURM_NTASKS, but it is no
        # rank of a step (its own `python ...` runs alone), so only srun's step variables count
        rank, world, local_rank, node, nodes = ints("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID",
                                                    "SLURM_NODEID", "SLURM_STEP_NUM_NODES")
        per_node = slurm_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world)))
        local_world = per_node[node] if 0 <= node < len(per_node) else 0
        launch = LaunchEnv("slurm", rank, world, local_rank, local_world, nodes)
    else:
        return LaunchEnv("single", 0, 1, 0, 1, 1)
    if not 0 <= launch.rank < launch.world or not 0 <= launch.local_rank < launch.local_world:
        raise DistmkError(f"inconsistent {launch.launcher} environment: {launch}")
    return launch


def slurm_tasks_per_node(compressed: str) -> list[int]:
    """SLURM's run-length form of tasks per node, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
    try:
        counts = []
        for part in compressed.split(","):
            count, _, repeat = part.partition("(x")
            counts += [int(count)] * int(repeat.rstrip(")") or 1)
        return counts
    except ValueError:
        raise DistmkError(f"cannot read SLURM tasks per node {compressed!r}") from None


def init_process_group(launch: LaunchEnv, backend: str) -> None:
    """torch.distributed over the launcher's ranks. torchrun provides the rendezvous address; under MPI or
    SLURM it defaults to 127.0.0.1 on one node (several nodes need MASTER_ADDR) and a port the ranks agree on."""
    import torch.distributed as dist
    if launch.world == 1 or dist.is_initialized():
        return
    if launch.num_nodes > 1 and "MASTER_ADDR" not in os.environ:
        raise DistmkError(f"{launch.world} ranks on {launch.num_nodes} nodes: set MASTER_ADDR to rank 0's node, e.g. "
                          "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_agreed_port(launch))
    dist.init_process_group(backend, rank=launch.rank, world_size=launch.world)


def _agreed_port(launch: LaunchEnv) -> int:
    """Under mpirun, a free port of rank 0's, broadcast with mpi4py; under SLURM, one derived from the job
    id (every task computes the same, and two jobs on a node rarely collide)."""
    if launch.launcher == "slurm":
        return 20000 + int(os.environ.get("SLURM_JOB_ID", 0)) % 20000
    try:
        from mpi4py import MPI
    except ImportError:
        return 29500
    port = None
    if launch.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    return MPI.COMM_WORLD.bcast(port, root=0)
