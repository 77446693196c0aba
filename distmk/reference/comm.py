"""How reference tasks that communicate reach the other ranks: `gather(t)` returns every rank's `t`, in
rank order, so each task combines them in a fixed order and all ranks compute bit-identical results.

SingleRank (tp=1), ThreadRanks (tp ranks simulated by threads of one process, for tests) and TorchDist
(torch.distributed, gloo on the CPU, under torchrun or MPI).
"""
from __future__ import annotations

import threading

import torch

from distmk.errors import DistmkError


class PeerFailed(DistmkError):
    """Another simulated rank failed, so this one cannot complete its exchange."""


class SingleRank:
    rank, world = 0, 1

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]


class _ThreadGroup:
    def __init__(self, world: int, timeout: float):
        self.world = world
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)


class ThreadRanks:
    """One simulated rank of a group of threads; the ranks meet at a barrier in every gather."""

    def __init__(self, group: _ThreadGroup, rank: int):
        self.group, self.rank, self.world = group, rank, group.world

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        try:
            g.slots[self.rank] = t.clone()
            g.barrier.wait()
            out = list(g.slots)
            g.barrier.wait()          # nobody overwrites a slot before everyone has read it
        except threading.BrokenBarrierError:
            raise PeerFailed(f"simulated rank {self.rank}: a peer rank failed or timed out") from None
        return out


def run_simulated_ranks(world: int, fn, timeout: float = 120.0) -> list:
    """Run fn(rank, comm) on `world` threads, one simulated rank each; return the results in rank order.

    If any rank raises, the others are released (their gather fails) and the first error is re-raised."""
    group = _ThreadGroup(world, timeout)
    results, errors = [None] * world, [None] * world

    def body(rank):
        try:
            results[rank] = fn(rank, ThreadRanks(group, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = e
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, PeerFailed)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class TorchDist:
    """torch.distributed: all_gather over the default process group (gloo on the CPU)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(out, t)
        return out
