"""Decode latency over tensor parallelism and model size: distmk and its baselines for every (model, tp), each
run one benchmarks/decode.py process (through launch/torchrun.sh for tp > 1), plus plots and a summary.

    python benchmarks/scaling.py --out-dir benchmarks/results/scaling            # every GPU, six presets
    python benchmarks/scaling.py --models llama-3-8b --tp 1,2 --allreduce-json allreduce.json --out-dir x
    python benchmarks/scaling.py --backend reference --device cpu --models tiny-llama --tp 1,2 \\
        --context 64 --iters 10 --out-dir x                                      # on the CPU, as CI runs it

Writes into --out-dir:
  scaling.json          one decode.py record per run, rewritten after every run (an interrupted sweep keeps
                        what it measured; --resume measures only what is missing); a failed run is a record
                        with its error
  runs/                 each run's JSON and log
  step_ms_vs_tp.png     distmk's step latency (and the torch.compile'd CUDA graph's, dashed) against tp, per model
  step_ms_vs_params.png step latency against model size, per tp
  efficiency_vs_tp.png  fraction of the HBM roofline (GPU only)
  speedup_vs_tp.png     speedup over the torch.compile'd CUDA-graph(+NCCL) baseline (GPU only)
  allreduce.png         all-reduce latency against message size, from --allreduce-json
  summary.md            the table of every run, and which figures had no data
Options it does not know go to every decode.py run (--batch, --context, --iters, --skip-hf). On a GPU every run
also times the torch.compile'd CUDA graph (decode.py --compile-baseline): that is the baseline compared against.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time

import torch
from tqdm import tqdm

import decode

try:
    import matplotlib
    matplotlib.use("Agg")                 # files only, no display
    import matplotlib.pyplot as plt
except ImportError:                       # measuring needs no matplotlib: the figures wait (summary.md says so)
    plt = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SIZE_SWEEP = ["qwen3-0.6b", "llama-3.2-1b", "qwen2.5-7b", "mistral-7b", "llama-3-8b", "qwen3-8b"]
ALLREDUCE_SERIES = {"distmk_us": "distmk", "nccl_eager_us": "NCCL eager", "nccl_graph_us": "NCCL in a CUDA graph",
                    "symm_mem_us": "torch symmetric memory"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(SIZE_SWEEP), help="comma-separated presets or checkpoint dirs")
    p.add_argument("--tp", help="comma-separated tensor-parallel sizes (default: powers of two up to the GPUs "
                                "visible; 1,2 on the CPU)")
    p.add_argument("--backend", choices=["triton", "reference"], default="triton")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--allreduce-json", help="records {world, bytes, distmk_us, nccl_eager_us, nccl_graph_us, "
                                            "symm_mem_us} (benchmarks/allreduce.py) for allreduce.png")
    p.add_argument("--resume", action="store_true", help="keep --out-dir's measured runs, run only the others")
    p.add_argument("--run-timeout", type=float, default=1200, help="seconds one run may take")
    args, decode_argv = p.parse_known_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.tp = [int(t) for t in args.tp.split(",")] if args.tp else default_tp(args.device)
    # decode.py's own parser checks the forwarded options now, not after an hour of sweeping
    decode.parse_args([*decode_argv, "--model", args.models[0], "--backend", args.backend, "--device", args.device])
    return args, decode_argv


def default_tp(device: str) -> list[int]:
    """1, 2, 4, ... up to the GPUs visible (1 without any); 1 and 2 on the CPU."""
    limit = torch.cuda.device_count() if device == "cuda" else 2
    sizes = [1]
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    return sizes


def run_name(model: str, tp: int) -> str:
    return f"{os.path.basename(model.rstrip('/'))}_tp{tp}"


def measure(model: str, tp: int, args, decode_argv: list[str]) -> dict:
    """One decode.py run; its record, or on failure a record that says why (the sweep goes on)."""
    out = os.path.join(args.out_dir, "runs", run_name(model, tp) + ".json")
    compiled = ["--compile-baseline"] if args.device == "cuda" and "--compile-baseline" not in decode_argv else []
    decode_args = [os.path.join(HERE, "decode.py"), "--model", model, "--backend", args.backend,
                   "--device", args.device, *decode_argv, *compiled, "--json", "--out", out]
    if tp == 1:
        command = [sys.executable, *decode_args]
    else:
        command = ["bash", os.path.join(REPO, "launch", "torchrun.sh"), str(tp), *decode_args]
    env = {**os.environ, "DISTMK_PYTHON": sys.executable}
    if args.device == "cpu":             # one thread per rank at every tp, as torchrun gives its ranks
        env.setdefault("OMP_NUM_THREADS", "1")
    if os.path.exists(out):
        os.remove(out)
    with open(os.path.join(args.out_dir, "runs", run_name(model, tp) + ".log"), "w") as log:
        code = run_bounded(command, log, env, args.run_timeout)
    if code == 0 and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    error = f"timed out after {args.run_timeout:.0f} s" if code is None else f"exit code {code}"
    return {"model": model, "tp": tp, "backend": args.backend, "device": args.device, "step_ms": None,
            "error": f"{error}; see runs/{run_name(model, tp)}.log", "command": " ".join(command)}


def run_bounded(command: list[str], log, env: dict, timeout: float) -> int | None:
    """The exit code of `command`, or None if it ran past `timeout`. When it times out or we are
    interrupted, it gets SIGTERM (torchrun passes it to its ranks), then every process below it is killed:
    torchrun's ranks run in sessions of their own and must not outlive it holding their GPUs."""
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            below = descendants(proc.pid)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            for pid in [proc.pid, *below, *descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc."""
    children = collections.defaultdict(list)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children[todo.pop()]:
            found.append(child)
            todo.append(child)
    return found


def write_json(path: str, data) -> None:
    """Replace `path` in one step, so a reader (or an interrupted sweep) never sees half a file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def sweep(args, decode_argv, records: list[dict], json_path: str) -> None:
    """Run every (model, tp) not yet in `records`, appending each result and rewriting the JSON at once."""
    done = {(r["model"], r["tp"]) for r in records}
    pending = [(m, tp) for m in args.models for tp in args.tp if (m, tp) not in done]
    bar = tqdm(pending, desc="scaling", unit="run", file=sys.stderr, dynamic_ncols=True)
    for model, tp in bar:
        bar.set_postfix_str(f"{model} tp={tp}")
        t0 = time.perf_counter()
        record = measure(model, tp, args, decode_argv)
        records.append(record)
        write_json(json_path, records)
        if record.get("step_ms"):
            outcome = f"{record['step_ms']:.3f} ms/step"
        else:
            outcome = record.get("error") or record.get("distmk_error")
        bar.write(f"{model} tp={tp}: {outcome} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


# ------------------------------------------------------------------------------------------- figures

def by_model(records: list[dict], models: list[str]) -> dict[str, list[dict]]:
    """Each model's measured records in tp order, models in the sweep's order."""
    measured = [r for r in records if not r.get("error")]
    return {m: sorted((r for r in measured if r["model"] == m), key=lambda r: r["tp"]) for m in models}


def plot_vs_tp(groups, key: str, ylabel: str, title: str, path: str, baseline_key: str | None = None,
               unit_line: bool = False) -> bool:
    """One line per model of `key` against tp (and `baseline_key` dashed); False when nothing to draw."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for i, (model, rows) in enumerate(groups.items()):
        color = f"C{i}"
        for field, style, label in ((key, "-o", model), (baseline_key, "--s", f"{model} compiled CUDA graph")):
            points = [(r["tp"], r.get(field)) for r in rows if field and r.get(field) is not None]
            if points:
                ax.plot(*zip(*points), style, color=color, label=label)
                drawn = True
    if drawn:
        tps = sorted({r["tp"] for rows in groups.values() for r in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(tps, [str(t) for t in tps])
        if unit_line:
            ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(xlabel="tensor-parallel ranks (tp)", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def plot_vs_params(records: list[dict], path: str) -> bool:
    """distmk's step latency against model size, one line per tp."""
    measured = [r for r in records if not r.get("error") and r.get("step_ms") and r.get("params")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, tp in enumerate(sorted({r["tp"] for r in measured})):
        rows = sorted((r for r in measured if r["tp"] == tp), key=lambda r: r["params"])
        ax.plot([r["params"] / 1e9 for r in rows], [r["step_ms"] for r in rows], "-o", color=f"C{i}", label=f"tp={tp}")
    if measured:
        ax.set(xlabel="parameters (billions)", ylabel="step latency (ms)", title="distmk decode step vs model size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return bool(measured)


def plot_allreduce(allreduce: list[dict], path: str) -> bool:
    """All-reduce latency against message size: one panel per world size, one line per implementation."""
    worlds = sorted({r["world"] for r in allreduce})
    if not worlds:
        return False
    fig, axes = plt.subplots(1, len(worlds), figsize=(5.5 * len(worlds), 4.5), sharey=True, squeeze=False)
    for ax, world in zip(axes[0], worlds):
        rows = sorted((r for r in allreduce if r["world"] == world), key=lambda r: r["bytes"])
        for i, (key, label) in enumerate(ALLREDUCE_SERIES.items()):
            points = [(r["bytes"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), "-o", color=f"C{i}", label=label, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="message size (bytes)", title=f"all-reduce, {world} ranks")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("latency (µs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def number(value, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def summary(records: list[dict], models: list[str], missing_figures: dict[str, str]) -> str:
    """Markdown: what ran where, one table row per run (tp scaling is step_ms at tp=1 over step_ms)."""
    measured = [r for r in records if not r.get("error")]
    lines = ["# Decode scaling", ""]
    if measured:
        first = measured[0]
        commits = sorted({str(r.get("distmk_commit")) for r in measured})
        lines += [f"{first.get('gpu') or 'CPU'}, {first['backend']} backend, {first['dtype']}, batch {first['batch']}, "
                  f"context {first['context']}; torch {first['torch']}, triton {first['triton']}, transformers "
                  f"{first['transformers']}; distmk {', '.join(commits)}; {min(r['date'] for r in measured)} to "
                  f"{max(r['date'] for r in measured)}.", ""]
    lines += ["| model | params (M) | tp | distmk ms | roofline ms | efficiency | CUDA graph ms | compiled ms "
              "| transformers ms | speedup vs compiled | speedup vs CUDA graph | tp scaling | error |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for model, rows in by_model(records, models).items():
        alone = next((r["step_ms"] for r in rows if r["tp"] == 1 and r.get("step_ms")), None)
        for r in rows:
            scaling = alone / r["step_ms"] if alone and r.get("step_ms") else None
            lines.append(f"| {model} | {number(r['params'] / 1e6 if r.get('params') else None, 1)} | {r['tp']} | {number(r.get('step_ms'))} "
                         f"| {number(r.get('roofline_ms'))} | {number(r.get('efficiency'), 2)} "
                         f"| {number(r.get('cudagraph_ms'))} | {number(r.get('cudagraph_compiled_ms'))} "
                         f"| {number(r.get('hf_eager_ms'), 2)} | {number(r.get('speedup_vs_compiled'), 2)} "
                         f"| {number(r.get('speedup_vs_cudagraph'), 2)} "
                         f"| {number(scaling, 2)} | {r.get('distmk_error') or ''} |")
    for r in records:
        if r.get("error"):
            lines.append(f"| {r['model']} | | {r['tp']} | | | | | | | | | | {r['error']} |")
    if missing_figures:
        lines += ["", "Not drawn:"] + [f"- {name}: {why}" for name, why in missing_figures.items()]
    return "\n".join(lines) + "\n"


def report(args, records: list[dict]) -> None:
    """Every figure that has data, and summary.md."""
    groups = by_model(records, args.models)
    out = args.out_dir
    figures = {   # name: (draws it and says whether there was data, what it needs)
        "step_ms_vs_tp.png": (lambda p: plot_vs_tp(groups, "step_ms", "step latency (ms)", "decode step vs tp", p,
                                                   baseline_key="cudagraph_compiled_ms"), "a measured run"),
        "step_ms_vs_params.png": (lambda p: plot_vs_params(records, p), "a measured run"),
        "efficiency_vs_tp.png": (lambda p: plot_vs_tp(groups, "efficiency", "fraction of the HBM roofline",
                                                      "roofline efficiency vs tp", p), "the HBM roofline (CUDA)"),
        "speedup_vs_tp.png": (lambda p: plot_vs_tp(groups, "speedup_vs_compiled", "speedup",
                                                   "distmk over the torch.compile'd CUDA graph (+NCCL)", p,
                                                   unit_line=True),
                              "the compiled CUDA-graph baseline (CUDA)"),
        "allreduce.png": (lambda p: bool(args.allreduce_json) and plot_allreduce(load_json(args.allreduce_json), p),
                          "--allreduce-json (benchmarks/allreduce.py)"),
    }
    if plt is None:
        missing = {name: "needs matplotlib (pip install -e '.[bench]'; then --resume draws it)" for name in figures}
    else:
        missing = {name: f"needs {needs}" for name, (draw, needs) in figures.items()
                   if not draw(os.path.join(out, name))}
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary(records, args.models, missing))


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    args, decode_argv = parse_args(argv)
    os.makedirs(os.path.join(args.out_dir, "runs"), exist_ok=True)
    json_path = os.path.join(args.out_dir, "scaling.json")
    records = []
    if args.resume and os.path.exists(json_path):
        records = [r for r in load_json(json_path) if not r.get("error")]
    interrupted = False
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # SIGTERM (timeout, scancel) as Ctrl-C
    try:
        sweep(args, decode_argv, records, json_path)
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted: {len(records)} runs kept in {json_path}; --resume continues", file=sys.stderr)
    write_json(json_path, records)
    report(args, records)
    print(f"wrote {json_path}, figures and summary.md in {args.out_dir}", file=sys.stderr)
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
