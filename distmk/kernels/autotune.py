"""Kernel options chosen by measurement: the first time a (GPU, model shape, tp, batch, task table) is
compiled, a few candidates are timed on the GPU and the fastest is cached on disk
($DISTMK_CACHE_DIR/autotune.json), so the next start is warm. Candidates vary what the device decides
and the compiler cannot: pipeline depth, L2 prefetch before waits, and tile heights."""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch

from distmk.timing import cuda_times

CANDIDATES = [
    {},                                   # the defaults: the ring megakernel where it runs, else tl's num_stages=4,
    {"prefetch_kb": 0},                   # prefetch_kb=256 (these vary the tl megakernel only)
    {"num_stages": 3},
    {"mlp_block_n": 32, "lm_block_n": 64},
    {"prefetch_kb": 0, "mlp_block_n": 32, "lm_block_n": 64},   # the two above together: each helped
    # qwen3-30b-a3b b1 on the tl kernel, and together more
    {"prefetch_kb": 64, "prefetch_tasks": "o_proj", "mlp_block_n": 32, "lm_block_n": 64},   # and of the prefetches
    # only o_proj's (its tiles wait through attention), which beat none
    {"prefetch_kb": 768},                 # more of each tile in L2 while its worker waits at a phase boundary
    {"ring_slots": 6, "ring_inputs": 2},  # the ring: six weight slots, two input slices (default: 5 and 4)
    {"kernel": "tl"},                     # where the ring runs: the tl megakernel, in case it is faster here
]


def cache_file() -> str:
    root = os.environ.get("DISTMK_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "distmk")
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, "autotune.json")


def tuning_key(spec, plan, table, dtype, device) -> str:
    """GPU, model shape, tp, batch, dtype, and a digest of the task table: options measured on one tiling
    are measured again when the lowering cuts the step differently."""
    gpu = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    shape = (f"h{spec.hidden_size}-i{plan.inter}-q{plan.num_heads}-kv{plan.num_kv_heads}-d{spec.head_dim}"
             f"-v{plan.vocab}-L{spec.num_layers}-bias{int(spec.qkv_bias)}-qkn{int(spec.qk_norm)}")
    if spec.moe_layers:          # experts, each one's rows on this rank, top k (dense keys stay as they were)
        shape += f"-moe{spec.num_experts}x{plan.expert_inter}k{spec.experts_per_token}"
    dtype = str(dtype).removeprefix("torch.")
    return f"{gpu}|{shape}|tp{plan.tp}|b{table.config.batch}|{dtype}|tasks{table.digest():08x}"


def cached_options(key: str) -> dict | None:
    try:
        with open(cache_file()) as f:
            return json.load(f)[key]["options"]
    except (OSError, ValueError, KeyError):
        return None


def _store(key: str, entry: dict) -> None:
    path = cache_file()
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[key] = entry
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def launch_times(executor, iters: int, warmup: int = 3) -> list[float]:
    """Milliseconds of `iters` steps as the runtime launches them (graph replays), each timed alone; raises
    if a worker's wait timed out, since such a step's time says nothing."""
    times = cuda_times(executor.launch, iters, warmup)
    executor.check()
    return times


def time_executor(executor, rows: int, position: int, iters: int = 20) -> float:
    """Median ms of one step over `rows` rows at `position` (the KV cache contents do not matter here)."""
    inputs = np.zeros((rows, 2 + executor.block_table.shape[1]), dtype=np.int64)     # token 0, block 0
    inputs[:, 1] = position
    executor.set_inputs(inputs)
    return statistics.median(launch_times(executor, iters))


def tune(key: str, make_executor, rows: int, position: int, log=None) -> dict:
    """Time every candidate built by make_executor(options); cache and return the fastest options."""
    timings = {}
    for options in CANDIDATES:
        t0 = time.perf_counter()
        executor = make_executor(options)
        timings[json.dumps(options)] = ms = time_executor(executor, rows, position)
        del executor
        torch.cuda.empty_cache()
        if log:
            log(f"autotune {options or 'defaults'}: {ms:.3f} ms/step ({time.perf_counter() - t0:.1f} s)")
    best = json.loads(min(timings, key=timings.get))
    _store(key, {"options": best, "timings_ms": timings, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return best
