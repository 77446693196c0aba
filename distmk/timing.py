"""GPU timing for autotuning and the benchmarks: `cuda_times` for decode steps and collectives, `kernel_ms`
(triton.testing.do_bench) for kernels on one GPU.

cuda_times times each call alone and synchronises before the next, because a decode step is launched after
the previous step's tokens came back: its launch latency is part of it, for the megakernel and the
CUDA-graph baselines alike. It runs a fixed number of calls rather than do_bench's time budget, whose
warm-up and repeat counts come from each process's own estimate: tensor-parallel ranks must run the same
number of steps and collectives, or one of them waits on its peers forever.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton.testing


def cuda_times(fn: Callable[[], object], iters: int, warmup: int = 3,
               before: Callable[[], object] | None = None) -> list[float]:
    """Milliseconds of each of `iters` calls of `fn` between CUDA events, after `warmup` untimed calls;
    `before` runs untimed ahead of every timed call (a barrier, so that ranks start together)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def kernel_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median ms of `fn` by triton.testing.do_bench: calls back to back with L2 flushed between them, so
    only device time counts. For kernels of one GPU that no peer waits on (the call count is this
    process's own)."""
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
