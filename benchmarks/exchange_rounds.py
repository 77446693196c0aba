"""Persistent kernels that run the megakernel's all-reduce tasks (tasks/ar_push.py + tasks/allreduce.py,
the same device functions, event waits and transports) for many rounds in one launch, so that a round
costs what it costs inside the megakernel: no launch, no host. Shared by allreduce.py and overlap.py.

Program p owns TILES_PER_PROGRAM row tiles of the H-wide vector. A round: for each tile, (optionally) the
o_proj-like GEMV tile that produces this rank's partial, then its push to every rank; then for each tile,
wait for every rank's push and reduce: tile i's exchange is in flight while tile i+1 computes. Pipelined,
the reduce of a round waits until after the next round's GEMV tiles (as the megakernel runs an all-reduce
tile's reduce after other tiles of other workers).
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

from distmk.device.primitives import wait_event
from distmk.tasks.allreduce import reduce_rows
from distmk.tasks.ar_push import ar_push_gpu
from distmk.tasks.base import WRITE_PARTIAL, row_parallel_gpu
from distmk.timing import cuda_times

_WRITE_PARTIAL = tl.constexpr(WRITE_PARTIAL)


@triton.jit
def reduce_tiles(first, g, n, x, xs, next_norm_w, exchange, counters, error, timeout, TILE: tl.constexpr,
                 TILES_PER_PROGRAM: tl.constexpr, H: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr,
                 SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """Wait for every rank's push of round g (counted since the first launch) of this program's tiles and
    reduce them; returns 0 if a wait gave up. A tile has a counter per slot, so a round's count is exact
    even while this rank's own pushes of the next round are already in."""
    ok = 1
    for i in tl.static_range(TILES_PER_PROGRAM):
        counter = counters + (first + i) * SLOTS + g % SLOTS
        if wait_event(counter, (g // SLOTS + 1).to(tl.int64) * WORLD, error, timeout, INTERPRET, True) < 0:
            tl.store(error, 1)
            ok = 0
        if ok == 1:
            reduce_rows((first + i) * TILE, TILE, g, n, x, xs, next_norm_w, exchange, H, B_PAD, WORLD, SLOTS,
                        BLOCK_N)
    return ok


@triton.jit(do_not_specialize=["n", "rank", "epoch0", "rounds", "timeout"])
def exchange_rounds(inp, w, partial, x, xs, next_norm_w, exchange, exchange_peers, counters, counter_peers, error,
                    n, rank, epoch0, rounds, timeout, LAYERS: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
                    TILE: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr, B_PAD: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GEMV: tl.constexpr, EXCHANGE: tl.constexpr,
                    PIPELINED: tl.constexpr, TRANSPORT: tl.constexpr, SIGNAL_ADD: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    # PIPELINED: round r reduces round r - 1, so an exchange is in flight during the next round's GEMV. A
    # rank then runs up to three rounds ahead of a peer still reading, hence four exchange slots.
    SLOTS: tl.constexpr = 4 if PIPELINED else 2
    first = tl.program_id(0) * TILES_PER_PROGRAM
    ok = 1
    for r in range(rounds):
        if ok == 1:
            g = epoch0 + r
            for i in tl.static_range(TILES_PER_PROGRAM):
                a0 = (first + i) * TILE
                if GEMV:
                    layer = r % LAYERS
                    row_parallel_gpu(inp, w + layer.to(tl.int64) * H * K, a0, TILE, _WRITE_PARTIAL, n, x, xs,
                                     next_norm_w, partial, K, H, B_PAD, BLOCK_N, BLOCK_K, DOT_PRECISION)
                    tl.debug_barrier()
                if EXCHANGE:
                    ar_push_gpu(a0, TILE, g, n, rank, (first + i) * SLOTS + g % SLOTS, partial, exchange,
                                exchange_peers, counters, counter_peers, H, B_PAD, WORLD, SLOTS, BLOCK_N, TRANSPORT,
                                SIGNAL_ADD)
            if EXCHANGE:
                if not PIPELINED:
                    ok = reduce_tiles(first, g, n, x, xs, next_norm_w, exchange, counters, error, timeout, TILE,
                                      TILES_PER_PROGRAM, H, B_PAD, WORLD, SLOTS, BLOCK_N, INTERPRET)
                elif r > 0:
                    ok = reduce_tiles(first, g - 1, n, x, xs, next_norm_w, exchange, counters, error, timeout,
                                      TILE, TILES_PER_PROGRAM, H, B_PAD, WORLD, SLOTS, BLOCK_N, INTERPRET)
    if EXCHANGE and PIPELINED and ok == 1:
        reduce_tiles(first, epoch0 + rounds - 1, n, x, xs, next_norm_w, exchange, counters, error, timeout, TILE,
                     TILES_PER_PROGRAM, H, B_PAD, WORLD, SLOTS, BLOCK_N, INTERPRET)


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
                 layers: int = 1, gemv: bool = False, exchange: bool = True, pipelined: bool = False,
                 device=None):
        from distmk.kernels.executor import TRANSPORTS
        self.comm, self.epoch = comm, 0
        dev = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
        interpret = dev.type != "cuda"          # Triton's interpreter (TRITON_INTERPRET=1): CPU tests
        dtype = torch.float32 if interpret else torch.bfloat16   # the interpreter has no bf16 dot
        b_pad = max(16, triton.next_power_of_2(n))
        slots = 4 if pipelined else 2          # exchange_rounds' SLOTS
        self.counters, counter_peers = comm.symmetric((tiles * slots,), torch.int64, dev)
        exchange_buf, exchange_peers = comm.symmetric((slots, comm.world, b_pad * H), torch.float32, dev)
        self.partial = torch.randn(b_pad, H, device=dev) * (comm.rank + 1)
        self.x = torch.zeros(b_pad, H, device=dev)
        xs, next_norm_w = torch.zeros(b_pad, H, device=dev, dtype=dtype), torch.ones(H, device=dev, dtype=dtype)
        self.inp = torch.randn(n, K, device=dev).to(dtype)
        self.w = (torch.randn(layers, H, K, device=dev) / K ** 0.5).to(dtype) if gemv else self.inp
        self.error = torch.zeros(1, dtype=torch.int64, device=dev)
        signal_add, self.options = -1, {"num_warps": 4, "num_stages": 1 if interpret else 4}
        if transport == "nvshmem":
            from distmk.device.nvshmem import extern_libs, signal_constants
            signal_add = signal_constants()["SIGNAL_ADD"]
            self.options["extern_libs"] = extern_libs()
        self.grid = (tiles // tiles_per_program,)
        self.args = dict(inp=self.inp, w=self.w, partial=self.partial, x=self.x, xs=xs, next_norm_w=next_norm_w,
                         exchange=exchange_buf,
                         exchange_peers=exchange_peers, counters=self.counters, counter_peers=counter_peers,
                         error=self.error, n=n, rank=comm.rank, timeout=10 ** 6 if interpret else int(5e9), LAYERS=layers, K=K, H=H,
                         TILE=H // tiles, TILES_PER_PROGRAM=tiles_per_program, B_PAD=b_pad, WORLD=comm.world,
                         BLOCK_N=min(32, H // tiles), BLOCK_K=min(256, K), GEMV=gemv, EXCHANGE=exchange,
                         PIPELINED=pipelined, TRANSPORT=TRANSPORTS.index(transport), SIGNAL_ADD=signal_add,
                         DOT_PRECISION="ieee" if interpret else "tf32", INTERPRET=interpret)
        if transport == "nvshmem":
            from distmk.device.nvshmem import compile_for_nvshmem
            compile_for_nvshmem(exchange_rounds, self.grid, epoch0=0, rounds=1, **self.args, **self.options)
        comm.gather(self.error)  # every rank zeroed its counters before any rank pushes into them

    def launch(self, rounds: int) -> None:
        exchange_rounds[self.grid](epoch0=self.epoch, rounds=rounds, **self.args, **self.options)
        if self.args["EXCHANGE"]:
            self.epoch += rounds

    def us_per_round(self, rounds: int, repeats: int = 5) -> float:
        """Median over `repeats` launches of `rounds` rounds each, ranks starting together."""
        self.launch(2)
        times = cuda_times(lambda: self.launch(rounds), repeats, warmup=0, before=self.comm.barrier)
        if int(self.error.item()):
            raise RuntimeError("an exchange wait timed out: a peer did not push")
        return statistics.median(times) * 1e3 / rounds
