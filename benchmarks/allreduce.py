"""All-reduce latency inside the megakernel against NCCL (eager and in a CUDA graph) and torch's
symmetric-memory one-shot all-reduce, for float32 vectors of 8 KB ... 4 MB (the megakernel reduces
float32 partial sums). One JSON list (world, bytes, distmk_us, distmk_nvshmem_us, nccl_eager_us,
nccl_graph_us, symm_mem_us) and a PNG plot:

    torchrun --standalone --nproc-per-node 2 benchmarks/allreduce.py --out benchmarks/results/allreduce.json

distmk_us is one round of the megakernel's own all-reduce tasks over peer pointers (distmk_nvshmem_us:
over NVSHMEM put-with-signal), measured as the time of many rounds in one persistent launch divided by
the rounds (benchmarks/exchange_rounds.py), so it holds no launch overhead, as inside a decode step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from distmk.timing import cuda_times

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exchange_rounds import ExchangeRounds, start_ranks  # noqa: E402


def cuda_us(fn, iters: int) -> float:
    """Median µs of fn() over iters timed calls (each timed alone, ranks synchronised first)."""
    return statistics.median(cuda_times(fn, iters, warmup=5, before=dist.barrier)) * 1e3


def graph_us(fn, iters: int = 20) -> float:
    """Median µs of one replay of a CUDA graph of fn() (warmed up on a side stream first). The graph is
    freed on return: one that holds NCCL work still alive at destroy_process_group() hangs the exit."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_us(graph.replay, iters)


def nccl_graph_us(t: torch.Tensor, per_graph: int = 50) -> float:
    return graph_us(lambda: [dist.all_reduce(t) for _ in range(per_graph)]) / per_graph


def symm_mem_us(numel: int) -> float | None:
    """torch.distributed._symmetric_memory's one-shot all-reduce, where this torch build has it."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
        t = symm_mem.empty(numel, dtype=torch.float32, device="cuda")
        symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        t.fill_(1.0)
        op = torch.ops.symm_mem.one_shot_all_reduce
        return cuda_us(lambda: op(t, "sum", dist.group.WORLD.group_name), 200)
    except Exception as e:            # not built, or not supported on this interconnect
        print(f"[allreduce] symmetric-memory one-shot unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def check(comm) -> None:
    """One round of the megakernel's all-reduce equals NCCL's sum, and both ranks agree bit for bit."""
    ex = ExchangeRounds(comm, n=4, H=4096, tiles=16, transport="pointer")
    ex.launch(1)
    torch.cuda.synchronize()
    expected = ex.partial[:4].clone()
    dist.all_reduce(expected)
    assert torch.allclose(ex.x[:4], expected, rtol=1e-6, atol=1e-5), "all-reduce result differs from NCCL's"
    assert all(torch.equal(t, ex.x) for t in comm.gather(ex.x)), "ranks disagree"


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r["bytes"] for r in records]
    for key, label in (("distmk_us", "distmk (megakernel, peer pointers)"),
                       ("distmk_nvshmem_us", "distmk (megakernel, NVSHMEM put-signal)"),
                       ("nccl_eager_us", "NCCL eager"), ("nccl_graph_us", "NCCL in a CUDA graph"),
                       ("symm_mem_us", "torch symm-mem one-shot")):
        points = [(s, r[key]) for s, r in zip(sizes, records) if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message (bytes, float32)")
    ax.set_ylabel("latency per all-reduce (µs)")
    ax.set_title(f"All-reduce latency, {records[0]['world']} × {records[0]['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-kb", type=int, default=8)
    p.add_argument("--max-kb", type=int, default=4096)
    p.add_argument("--out", default="benchmarks/results/allreduce.json")
    args = p.parse_args()
    launch, comm = start_ranks(p)
    records = []
    try:
        check(comm)
        kb = args.min_kb
        while kb <= args.max_kb:
            numel = kb * 256
            tiles = max(1, min(128, numel // 256))
            rounds = 2000 if kb <= 256 else 300
            record = {"world": launch.world, "bytes": kb * 1024, "gpu": torch.cuda.get_device_name()}
            for transport, key in (("pointer", "distmk_us"), ("nvshmem", "distmk_nvshmem_us")):
                record[key] = ExchangeRounds(comm, 1, numel, tiles, transport).us_per_round(rounds)
            t = torch.ones(numel, device="cuda")
            record["nccl_eager_us"] = cuda_us(lambda: dist.all_reduce(t), 200)
            record["nccl_graph_us"] = nccl_graph_us(t)
            record["symm_mem_us"] = symm_mem_us(numel)
            records.append(record)
            if launch.rank == 0:
                print(json.dumps(record), file=sys.stderr, flush=True)
            kb *= 2
    finally:
        comm.close()
        dist.destroy_process_group()
    if launch.rank == 0:
        stamp = {"torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(["torchrun", f"--nproc-per-node {launch.world}", *sys.argv])}
        records = [{**r, **stamp} for r in records]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
        plot(records, os.path.splitext(args.out)[0] + ".png")
        print(json.dumps(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
