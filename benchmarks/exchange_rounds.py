"""A persistent kernel that runs the megakernel's all-reduce (the push of a row-parallel tile, device/exchange.py, and
the allreduce task, tasks/allreduce.py: the same device functions, event waits and transports) for many rounds in one
launch, so that a round costs what it costs inside the megakernel: no launch, no host (allreduce.py). Program p owns
row tile p of the H-wide vector; a round pushes its partial to every rank, waits for every rank's push and reduces.
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from distmk.device.exchange import exchange_region, push_block, push_signal
from distmk.device.primitives import wait_event
from distmk.tasks.allreduce import reduce_rows
from distmk.timing import cuda_times

SLOTS = 2       # exchange slots: a rank is at most one round ahead of a peer still reading


@triton.jit(do_not_specialize=["n", "rank", "epoch0", "rounds", "timeout"])
def exchange_rounds(partial, x, xs, next_norm_w, exchange, exchange_peers, counters, counter_peers, error, n, rank,
                    epoch0, rounds, timeout, H: tl.constexpr, TILE: tl.constexpr, B_PAD: tl.constexpr,
                    WORLD: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Rounds epoch0 .. epoch0 + rounds - 1 (counted since the first launch: a tile has a counter per slot, so a
    round's count is exact even while this rank's own push of the next round is already in)."""
    tile = tl.program_id(0)
    row0 = tile * TILE
    rb = tl.arange(0, B_PAD)
    rn = tl.arange(0, BLOCK_N)
    ok = 1
    for r in range(rounds):
        if ok == 1:
            g = epoch0 + r
            counter = tile * SLOTS + g % SLOTS
            region = exchange_region(row0, g, rank, H, B_PAD, WORLD, SLOTS)
            for j in range(0, TILE, BLOCK_N):       # the tile's product, here read from `partial`
                mask = (rb < n)[:, None] & (j + rn < TILE)[None, :]
                rows = tl.load(partial + rb[:, None] * H + (row0 + j + rn)[None, :], mask=mask, other=0.0)
                push_block(rows, rb, j + rn, mask, region, TILE, exchange, exchange_peers, WORLD, TRANSPORT)
            push_signal(region, n, TILE, rank, counter, exchange, counters, counter_peers, WORLD, TRANSPORT,
                        SIGNAL_ADD)
            if wait_event(counters + counter, (g // SLOTS + 1).to(tl.int64) * WORLD, error, timeout, INTERPRET,
                          True) < 0:
                tl.store(error, 1)
                ok = 0
            else:
                reduce_rows(row0, TILE, g, n, x, xs, next_norm_w, exchange, H, B_PAD, WORLD, SLOTS, BLOCK_N)


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
    """Buffers and launches of exchange_rounds for one vector shape [n, H] in `tiles` row tiles on this rank of
    `comm`; its partial sum is random, scaled by rank + 1."""

    def __init__(self, comm, n: int, H: int, tiles: int, transport: str, device=None):
        from distmk.kernels.executor import TRANSPORTS
        self.comm, self.epoch = comm, 0
        dev = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
        interpret = dev.type != "cuda"          # Triton's interpreter (TRITON_INTERPRET=1): CPU tests
        dtype = torch.float32 if interpret else torch.bfloat16
        b_pad = max(16, triton.next_power_of_2(n))
        self.counters, counter_peers = comm.symmetric((tiles * SLOTS,), torch.int64, dev)
        exchange_buf, exchange_peers = comm.symmetric((SLOTS, comm.world, b_pad * H), torch.float32, dev)
        self.partial = torch.randn(b_pad, H, device=dev) * (comm.rank + 1)
        self.x = torch.zeros(b_pad, H, device=dev)
        xs, next_norm_w = torch.zeros(b_pad, H, device=dev, dtype=dtype), torch.ones(H, device=dev, dtype=dtype)
        self.error = torch.zeros(1, dtype=torch.int64, device=dev)
        signal_add, self.options = -1, {"num_warps": 4, "num_stages": 1 if interpret else 4}
        if transport == "nvshmem":
            from distmk.device.nvshmem import extern_libs, signal_constants
            signal_add = signal_constants()["SIGNAL_ADD"]
            self.options["extern_libs"] = extern_libs()
        self.grid = (tiles,)
        self.args = dict(partial=self.partial, x=self.x, xs=xs, next_norm_w=next_norm_w, exchange=exchange_buf,
                         exchange_peers=exchange_peers, counters=self.counters, counter_peers=counter_peers,
                         error=self.error, n=n, rank=comm.rank, timeout=10 ** 6 if interpret else int(5e6), H=H,
                         TILE=H // tiles, B_PAD=b_pad, WORLD=comm.world, BLOCK_N=min(32, H // tiles),
                         TRANSPORT=TRANSPORTS.index(transport), SIGNAL_ADD=signal_add, INTERPRET=interpret)
        if transport == "nvshmem":
            from distmk.device.nvshmem import compile_for_nvshmem
            compile_for_nvshmem(exchange_rounds, self.grid, epoch0=0, rounds=1, **self.args, **self.options)
        comm.gather(self.error)  # every rank zeroed its counters before any rank pushes into them

    def launch(self, rounds: int) -> None:
        exchange_rounds[self.grid](epoch0=self.epoch, rounds=rounds, **self.args, **self.options)
        self.epoch += rounds

    def us_per_round(self, rounds: int, repeats: int = 5) -> float:
        """Median over `repeats` launches of `rounds` rounds each, ranks starting together."""
        self.launch(2)
        times = cuda_times(lambda: self.launch(rounds), repeats, warmup=0, before=self.comm.barrier)
        if int(self.error.item()):
            raise RuntimeError("an exchange wait timed out: a peer did not push")
        return statistics.median(times) * 1e3 / rounds
