"""Timing the megakernel's decode step as the runtime runs it: CUDA-graph replays of one launch."""
from __future__ import annotations

import statistics
import time

import torch

from distmk.graph import GraphConfig
from distmk.kernels.autotune import launch_times


def decode_engine(model: str, batch: int, context: int, *, comm=None, workers: int | None = None,
                  trace: bool = False, block_size: int = 16, **kernel_options):
    """A bf16 triton Engine (one rank of `comm`'s, or alone) whose `batch` rows sit at position
    `context - 1` of their own sequences, with random KV-cache contents, ready for executor.launch()."""
    from distmk.runtime.engine import Engine, default_workers
    device = torch.device("cuda", torch.cuda.current_device())
    workers = workers or default_workers("triton", device)
    config = GraphConfig(batch=batch, workers=workers, context=context)
    max_context = -(-context // block_size) * block_size
    engine = Engine(model, tp=comm.world if comm else 1, rank=comm.rank if comm else 0, comm=comm,
                    backend="triton", device=device, dtype=torch.bfloat16, config=config,
                    max_context=max_context, block_size=block_size,
                    kernel_options={"trace": trace, **kernel_options}, autotune=not kernel_options)
    engine.kv.k.normal_()
    engine.kv.v.normal_()
    blocks = [engine.kv.allocate([], context) for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)            # every rank steps the same tokens
    tokens = torch.randint(0, engine.spec.vocab_size, (batch,), generator=generator).tolist()
    engine.step(tokens, [context - 1] * batch, blocks)     # compiles, captures, checks the watchdog
    return engine


def traced_step(engine):
    """Per-task timings of one step of `engine`'s table, run by a tracing copy of its executor (same
    options, plain launch: the timer stores cost a little, so timed steps run untraced)."""
    from distmk.kernels.executor import TritonExecutor
    ex = engine.executor
    traced = TritonExecutor(engine.table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype,
                            **{**ex.options, "trace": True, "cuda_graph": False})
    for name in ("tokens", "positions", "block_table", "rows"):
        getattr(traced, name).copy_(getattr(ex, name))
    for _ in range(3):                      # compile, warm up; the last step is the one kept
        traced.launch()
    traced.check()
    return traced.timings()


def bench_comm():
    """The communicator of a benchmark under torchrun with more than one rank (NVSHMEM), else None."""
    import torch.distributed as dist
    if dist.is_initialized() and dist.get_world_size() > 1:
        from distmk.comm.nvshmem import NvshmemComm
        from distmk.dist import detect_launch
        return NvshmemComm(detect_launch())
    return None


def distmk_step_ms(model: str, batch: int, context: int, iters: int = 200, breakdown: bool = False,
                   **options) -> dict:
    """Median step time of this rank; under torchrun every rank runs its shard and they exchange through
    NVSHMEM, so each rank's step includes the waits on its peers. With `breakdown`, also where the time of
    one traced step went (text), the fraction of worker time spent waiting on peers and the exposed
    all-reduce time."""
    from distmk.kernels import trace
    comm = bench_comm()
    try:
        t0 = time.perf_counter()
        engine = decode_engine(model, batch, context, comm=comm, **options)
        setup_s = time.perf_counter() - t0
        ex = engine.executor
        times = launch_times(ex, iters, warmup=10)
        result = {"step_ms": statistics.median(times), "step_ms_min": min(times), "tp": engine.plan.tp,
                  "mode": "cudagraph" if ex.use_graph else "launch", "workers": engine.table.num_workers,
                  "tasks": engine.table.num_tasks, "setup_s": round(setup_s, 2),
                  "options": {k: v for k, v in ex.options.items() if k not in ("trace", "cuda_graph")}}
        if breakdown:
            timings = traced_step(engine)
            waits = trace.wait_summary(engine.table, timings)
            exposed = trace.exposed_allreduce_ns(engine.table, timings)
            result.update(traced_span_ms=waits["span_ns"] / 1e6, peer_wait_fraction=waits["peer_wait_fraction"],
                          allreduce_us=exposed / 1e3 if exposed is not None else None,
                          breakdown=trace.breakdown(engine.table, timings))
        return result
    finally:
        if comm is not None:
            comm.close()
