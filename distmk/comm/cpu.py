"""How tasks that communicate reach the other ranks.

`gather(t)` returns every rank's `t`, in rank order, so reference tasks combine them in a fixed order and
all ranks compute bit-identical results. `symmetric(shape, dtype, device)` allocates a tensor that every
rank has, and returns it with the addresses of all ranks' copies (peer pointers), which the megakernel
writes into directly.

SingleRank (tp=1), ThreadRanks (tp ranks simulated by threads of one process; their tensors share one address
space, so they are symmetric memory: on the CPU for the tests, and on one GPU as virtual ranks, each thread
launching on a CUDA stream of its own so that every rank's persistent kernel is resident at once) and TorchDist
(torch.distributed, gloo on the CPU, under torchrun or MPI; no symmetric memory).
"""
from __future__ import annotations

import threading

import torch

from distmk.errors import DistmkError


# What virtual ranks need of CUDA, set before it starts: every rank's persistent kernel waits for the others', so
# nothing may wait for a running kernel to end. Their streams each take a hardware queue of their own
# (CUDA_DEVICE_MAX_CONNECTIONS' most), or one rank's kernel can queue behind another's; and kernels load when the
# process loads them, not at first use (lazy loading waits for the kernels running, which wait for this rank: a
# thread's first torch.cat, or a rank's first launch, stalled its peers until their watchdogs fired).
VIRTUAL_RANKS_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "32", "CUDA_MODULE_LOADING": "EAGER"}


class PeerFailed(DistmkError):
    """Another simulated rank failed, so this one cannot complete its exchange."""


class SingleRank:
    rank, world = 0, 1

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.clone()]

    def symmetric(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        return _with_peers(torch.zeros(shape, dtype=dtype, device=device), self)


def _with_peers(local: torch.Tensor, comm) -> tuple[torch.Tensor, torch.Tensor]:
    """local, and an int64 tensor of every rank's address of its copy (exchanged with gather)."""
    addresses = comm.gather(torch.tensor([local.data_ptr()], dtype=torch.int64))
    return local, torch.cat(addresses).to(local.device)


class _ThreadGroup:
    def __init__(self, world: int, timeout: float):
        self.world = world
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)


class ThreadRanks:
    """One simulated rank of a group of threads; the ranks meet at a barrier in every gather. On a GPU they are
    virtual ranks: every rank's buffers are in the one device's memory (peers_on_device), and its workers share
    the device's SMs with the other ranks' (ranks_on_device)."""
    peers_on_device = True

    def __init__(self, group: _ThreadGroup, rank: int):
        self.group, self.rank, self.world = group, rank, group.world
        self.ranks_on_device = group.world

    def gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        try:
            g.slots[self.rank] = t.clone()
            if t.is_cuda:               # the peers read it on streams of their own
                torch.cuda.current_stream(t.device).synchronize()
            g.barrier.wait()
            out = list(g.slots)
            g.barrier.wait()          # nobody overwrites a slot before everyone has read it
        except threading.BrokenBarrierError:
            raise PeerFailed(f"simulated rank {self.rank}: a peer rank failed or timed out") from None
        return out

    def symmetric(self, shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        return _with_peers(torch.zeros(shape, dtype=dtype, device=device), self)

    def barrier(self) -> None:
        """Every rank's work so far on its stream is done (the kernels' peers may use what it wrote)."""
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.gather(torch.zeros(1))

    def broadcast(self, t: torch.Tensor) -> None:
        """t becomes rank 0's t on every rank (the server's plans: serve/lockstep.py)."""
        t.copy_(self.gather(t)[0])


def run_simulated_ranks(world: int, fn, timeout: float = 120.0, lead_here: bool = False) -> list:
    """Run fn(rank, comm) on `world` threads, one simulated rank each; return the results in rank order. Where
    CUDA is available each thread works on a stream of its own (a blocking one: never the legacy default stream,
    which would wait for the other ranks' persistent kernels), so that the ranks' kernels run side by side.
    `lead_here`: rank 0 runs on the calling thread (a server's, which must stay the main thread).

    If any rank raises, the others are released (their gather fails) and the first error is re-raised."""
    group = _ThreadGroup(world, timeout)
    results, errors = [None] * world, [None] * world

    def body(rank):
        try:
            if torch.cuda.is_available():
                with torch.cuda.stream(torch.cuda.Stream()):
                    results[rank] = fn(rank, ThreadRanks(group, rank))
            else:
                results[rank] = fn(rank, ThreadRanks(group, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = e
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(int(lead_here), world)]
    for t in threads:
        t.start()
    if lead_here:
        body(0)
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

    def symmetric(self, shape, dtype, device):
        raise DistmkError("the triton backend at tp>1 needs symmetric memory across processes (NVSHMEM), "
                          "which torch.distributed does not give; use --backend reference")
