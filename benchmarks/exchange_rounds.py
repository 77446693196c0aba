"""Persistent kernels that run the megakernel's all-reduce tasks (tasks/ar_push.py + tasks/allreduce.py,
the same device functions, event waits and transports) for many rounds in one launch, so that a round
costs what it costs inside the megakernel: no launch, no host. Shared by allreduce.py and overlap.py.

Program p owns TILES_PER_PROGRAM row tiles of the H-wide vector. A round: for each tile, (optionally) the
o_proj-like GEMV tile that produces this rank's partial, then its push to every rank; then for each tile,
wait for every rank's push and reduce. Tile i's exchange is in flight while tile i+1 computes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from distmk.kernels.primitives import wait_event
from distmk.tasks.allreduce import allreduce_gpu
from distmk.tasks.ar_push import ar_push_gpu
from distmk.tasks.base import WRITE_PARTIAL, row_parallel_gpu

_WRITE_PARTIAL = tl.constexpr(WRITE_PARTIAL)


@triton.jit(do_not_specialize=["n", "rank", "epoch0", "rounds", "timeout"])
def exchange_rounds(inp, w, partial, x, exchange, exchange_peers, counters, counter_peers, error, n, rank, epoch0,
                    rounds, timeout, LAYERS: tl.constexpr, K: tl.constexpr, H: tl.constexpr, TILE: tl.constexpr,
                    TILES_PER_PROGRAM: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GEMV: tl.constexpr, EXCHANGE: tl.constexpr, TRANSPORT: tl.constexpr,
                    SIGNAL_ADD: tl.constexpr):
    first = tl.program_id(0) * TILES_PER_PROGRAM
    ok = 1
    for r in range(rounds):
        if ok == 1:
            for i in tl.static_range(TILES_PER_PROGRAM):
                a0 = (first + i) * TILE
                if GEMV:
                    layer = r % LAYERS
                    row_parallel_gpu(inp, w + layer.to(tl.int64) * H * K, a0, TILE, _WRITE_PARTIAL, n, x, partial,
                                     K, H, B_PAD, BLOCK_N, BLOCK_K, "tf32")
                    tl.debug_barrier()
                if EXCHANGE:
                    ar_push_gpu(a0, TILE, r, n, rank, first + i, partial, exchange, exchange_peers, counters,
                                counter_peers, H, B_PAD, WORLD, BLOCK_N, TRANSPORT, SIGNAL_ADD)
            if EXCHANGE:
                for i in tl.static_range(TILES_PER_PROGRAM):
                    target = (epoch0 + r + 1).to(tl.int64) * WORLD
                    if wait_event(counters + first + i, target, error, timeout, False, True) < 0:
                        tl.store(error, 1)
                        ok = 0
                    if ok == 1:
                        allreduce_gpu((first + i) * TILE, TILE, r, n, x, exchange, H, B_PAD, WORLD, BLOCK_N)


def start_ranks(parser):
    """This rank's launch environment and NVSHMEM communicator, with NCCL up for the baselines (the
    benchmark needs 2 or more ranks: torchrun, mpirun or srun)."""
    import os
    from distmk.comm.nvshmem import NvshmemComm
    from distmk.dist import detect_launch, init_process_group
    launch = detect_launch()
    if launch.world < 2:
        parser.error("run under torchrun / mpirun with 2 or more ranks")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(launch.local_rank)
    init_process_group(launch, "nccl")
    return launch, NvshmemComm(launch)


class ExchangeRounds:
    """Buffers and launches of exchange_rounds for one vector shape [n, H] on this rank of `comm`."""

    def __init__(self, comm, n: int, H: int, tiles: int, tiles_per_program: int, transport: str, K: int = 16,
                 layers: int = 1, gemv: bool = False, exchange: bool = True):
        from distmk.kernels.executor import TRANSPORTS
        self.comm, self.epoch = comm, 0
        dev = torch.device("cuda", torch.cuda.current_device())
        b_pad = max(16, triton.next_power_of_2(n))
        self.counters, counter_peers = comm.symmetric((tiles,), torch.int64, dev)
        exchange_buf, exchange_peers = comm.symmetric((2, comm.world, b_pad * H), torch.float32, dev)
        self.partial = torch.randn(b_pad, H, device=dev) * (comm.rank + 1)
        self.x = torch.zeros(b_pad, H, device=dev)
        self.inp = torch.randn(n, K, device=dev).to(torch.bfloat16)
        self.w = (torch.randn(layers, H, K, device=dev) / K ** 0.5).to(torch.bfloat16) if gemv else self.inp
        self.error = torch.zeros(1, dtype=torch.int64, device=dev)
        signal_add, self.options = -1, {"num_warps": 4, "num_stages": 4}
        if transport == "nvshmem":
            from distmk.comm.nvshmem_device import extern_libs, signal_constants
            signal_add = signal_constants()["SIGNAL_ADD"]
            self.options["extern_libs"] = extern_libs()
        self.grid = (tiles // tiles_per_program,)
        self.args = dict(inp=self.inp, w=self.w, partial=self.partial, x=self.x, exchange=exchange_buf,
                         exchange_peers=exchange_peers, counters=self.counters, counter_peers=counter_peers,
                         error=self.error, n=n, rank=comm.rank, timeout=int(5e9), LAYERS=layers, K=K, H=H,
                         TILE=H // tiles, TILES_PER_PROGRAM=tiles_per_program, B_PAD=b_pad, WORLD=comm.world,
                         BLOCK_N=min(32, H // tiles), BLOCK_K=min(256, K), GEMV=gemv, EXCHANGE=exchange,
                         TRANSPORT=TRANSPORTS.index(transport), SIGNAL_ADD=signal_add)
        if transport == "nvshmem":
            from distmk.comm.nvshmem_device import compile_for_nvshmem
            compile_for_nvshmem(exchange_rounds, self.grid, epoch0=0, rounds=1, **self.args, **self.options)
        torch.cuda.synchronize()
        comm.barrier()          # every rank zeroed its counters before any rank pushes into them

    def launch(self, rounds: int) -> None:
        exchange_rounds[self.grid](epoch0=self.epoch, rounds=rounds, **self.args, **self.options)
        if self.args["EXCHANGE"]:
            self.epoch += rounds

    def us_per_round(self, rounds: int, repeats: int = 5) -> float:
        """Median over `repeats` launches of `rounds` rounds each, ranks starting together."""
        import statistics
        self.launch(2)
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            self.comm.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.launch(rounds)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / rounds)
        if int(self.error.item()):
            raise RuntimeError("an exchange wait timed out: a peer did not push")
        return statistics.median(times)
