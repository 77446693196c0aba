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
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world, local_rank = ints("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
        nodes = int(env.get("SLURM_NNODES", 1))
        launch = LaunchEnv("slurm", rank, world, local_rank, -(-world // nodes), nodes)
    else:
        return LaunchEnv("single", 0, 1, 0, 1, 1)
    if not 0 <= launch.rank < launch.world or not 0 <= launch.local_rank < launch.local_world:
        raise DistmkError(f"inconsistent {launch.launcher} environment: {launch}")
    return launch


def init_process_group(launch: LaunchEnv, backend: str) -> None:
    """torch.distributed over the launcher's ranks. torchrun provides the rendezvous address; under MPI or
    SLURM it defaults to 127.0.0.1 (set MASTER_ADDR for several nodes) and a port the ranks agree on."""
    import torch.distributed as dist
    if launch.world == 1 or dist.is_initialized():
        return
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
