"""Timing a decode step as the runtime runs it: the megakernel by CUDA-graph replays of one launch, the
reference executor (the backend CI and CPU-only machines run) by wall clock."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from distmk.graph import GraphConfig
from distmk.kernels.autotune import launch_times


def decode_step(model: str, batch: int, context: int, *, comm=None, backend: str = "triton", device=None,
                workers: int | None = None, trace: bool = False, block_size: int = 16, graph: dict | None = None,
                quantize: str | None = None, **kernel_options) -> tuple[object, Callable[[], object]]:
    """An Engine (one rank of `comm`'s, or alone) whose `batch` rows sit at position `context - 1` of their
    own sequences, with random KV-cache contents, after its first step (for triton: compiled, captured,
    watchdog checked, so executor.launch() replays it); and a function that runs that step again.
    bf16 on a GPU, float32 on the CPU; `device` defaults to the current GPU; `graph`: GraphConfig fields
    (e.g. tile_rows) beyond batch, workers and context. The step function's `rows` holds its tokens, positions and
    block tables."""
    from distmk.runtime.engine import Engine, device_fields
    device = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
    config = GraphConfig(batch=batch, context=context, **(graph or {}),
                         **device_fields(backend, device, workers, getattr(comm, "ranks_on_device", 1)))
    max_context = -(-context // block_size) * block_size
    engine = Engine(model, tp=comm.world if comm else 1, rank=comm.rank if comm else 0, comm=comm,
                    backend=backend, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                    config=config, max_context=max_context, block_size=block_size,
                    kernel_options={"trace": trace, **kernel_options}, autotune=not kernel_options, quantize=quantize)
    engine.kv.k.normal_()
    engine.kv.v.normal_()
    blocks = [engine.kv.allocate([], context) for _ in range(batch)]
    generator = torch.Generator().manual_seed(0)            # every rank steps the same tokens
    tokens = torch.randint(0, engine.spec.vocab_size, (batch,), generator=generator).tolist()

    def step():
        return engine.step(tokens, [context - 1] * batch, blocks)

    step.rows = {"tokens": tokens, "positions": [context - 1] * batch, "blocks": blocks}
    step()
    return engine, step


def traced_step(engine):
    """Per-task timings of one step of `engine`'s table, run by a tracing copy of its executor (same
    options, plain launch: the timer stores cost a little, so timed steps run untraced)."""
    from distmk.kernels.executor import TritonExecutor
    ex = engine.executor
    traced = TritonExecutor(engine.table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype,
                            **{**ex.options.as_dict(), "trace": True, "cuda_graph": False})
    traced.inputs.copy_(ex.inputs)          # the last step's rows
    for _ in range(3):                      # compile, warm up; the last step is the one kept
        traced.launch()
    traced.check()
    return traced.timings()


def decode_engine(model: str, batch: int, context: int, **options):
    """decode_step's Engine alone, ready for executor.launch()."""
    return decode_step(model, batch, context, **options)[0]


def wall_times(step: Callable[[], object], iters: int, warmup: int = 3) -> list[float]:
    """Milliseconds of `iters` calls of `step` by wall clock (the CPU's; a GPU step would need a sync)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_comm(backend: str):
    """The communicator of a benchmark under torch.distributed with more than one rank (the megakernel's
    ranks exchange through NVSHMEM, the reference executor's through torch.distributed), else None."""
    import torch.distributed as dist
    from distmk.comm import backend_comm
    from distmk.dist import detect_launch
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    return backend_comm(backend, detect_launch())


def distmk_step_ms(model: str, batch: int, context: int, iters: int = 200, backend: str = "triton", device=None,
                   breakdown: bool = False, keep: dict | None = None, comm=None, **options) -> dict:
    """Median step time of this rank; each rank's step includes the waits on its peers. With `breakdown`
    (triton), also where the time of one traced step went (text), the fraction of worker time spent
    waiting on peers and the exposed all-reduce time. `keep`, a dict, receives the engine and its step's
    rows as soon as it is built ("engine", "step": a function that runs the step again and returns its
    workspace, "tokens", "positions", "blocks"), so that the caller can run baselines on the same weights
    and KV cache rather than load a second copy. `comm`: this rank's communicator (virtual_tp_step_ms's),
    else the launch's (bench_comm)."""
    from distmk.kernels import trace
    comm = comm or bench_comm(backend)
    try:
        t0 = time.perf_counter()
        engine, step = decode_step(model, batch, context, comm=comm, backend=backend, device=device, **options)
        setup_s = time.perf_counter() - t0
        if keep is not None:
            keep.update(engine=engine, step=step, **step.rows)
        ex = engine.executor
        if comm is not None and engine.device.type == "cuda":
            comm.barrier()          # every rank built and captured: the timed steps start together
        if backend == "triton":
            times, mode = launch_times(ex, iters, warmup=10), "cudagraph" if ex.use_graph else "launch"
        else:
            times, mode = wall_times(step, iters), "reference"
        result = {"step_ms": statistics.median(times), "step_ms_min": min(times), "tp": engine.plan.tp,
                  "mode": mode, "workers": engine.table.num_workers, "tasks": engine.table.num_tasks,
                  "tile_rows": engine.config.tile_rows, "setup_s": round(setup_s, 2)}
        if backend == "triton":
            result["options"] = {k: v for k, v in ex.options.as_dict().items() if k not in ("trace", "cuda_graph")}
            result["kernel"] = ex.kernel_name
            if breakdown:
                timings = traced_step(engine)
                waits = trace.wait_summary(engine.table, timings)
                exposed = trace.exposed_allreduce_ns(engine.table, timings)
                latency = trace.push_to_consume_ns(engine.table, timings)
                result.update(traced_span_ms=waits["span_ns"] / 1e6, peer_wait_fraction=waits["peer_wait_fraction"],
                              allreduce_us=exposed / 1e3 if exposed is not None else None,
                              push_to_consume_us={k: v / 1e3 if k != "tiles" else v for k, v in latency.items()}
                              if latency else None,
                              breakdown=trace.breakdown(engine.table, timings) + "\n"
                              + trace.phase_timeline(engine.table, timings))
        return result
    finally:
        if comm is not None and hasattr(comm, "close"):
            comm.close()


def virtual_tp_step_ms(model: str, batch: int, context: int, tp: int, iters: int = 200, **options) -> dict:
    """distmk_step_ms of `tp` virtual ranks: threads of this process on this one GPU, each with its share of the
    SMs (comm/cpu.py ThreadRanks), stepping together through the exchanges. Rank 0's figures, with every rank's
    median step time beside them."""
    from distmk.comm.cpu import run_simulated_ranks
    per_rank = run_simulated_ranks(tp, lambda rank, comm: distmk_step_ms(model, batch, context, iters, comm=comm,
                                                                         **options), timeout=1800)
    return {**per_rank[0], "rank_step_ms": [r["step_ms"] for r in per_rank]}
