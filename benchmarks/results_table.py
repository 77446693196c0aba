"""One short table of everything a device session measured under a results folder: the decode, all-reduce,
overlap, serve-load and start-up JSON and the GPU tests' last lines (the run_h200*.sh scripts print it last).

    python benchmarks/results_table.py benchmarks/results/h100-2026-12-05-f21ea06

With --table KIND ARGS, one of the tables of figures of README.md, benchmarks/README.md and docs/, made from its
runs' JSON (TABLES: headline, decode, kernels, tp, fp8, allreduce, overlap, probe, serve); each page marks such a table with the line
`<!-- table: KIND ARGS -->` before it. A figure in a table is generated, never typed: tests/test_readme_commands.py
checks every marked table and that every table of figures is marked.
"""
import glob
import json
import os
import re
import sys


def fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def decode_rows(records):
    for r in records:
        if r.get("step_ms") is None:
            error = r.get("error") or r.get("distmk_error")
            yield f"decode {r.get('model')} tp{r.get('tp')} b{r.get('batch')}: {error}"
            continue
        virtual = r.get("virtual_tp") or 1
        ranks = f"vtp{virtual}" if virtual > 1 else f"tp{r['tp']}"
        versus = f" ({fmt(r.get('step_vs_tp1'), '.3f')}x tp1 {fmt(r.get('tp1_step_ms'), '.3f')})" if virtual > 1 else ""
        yield (f"decode {r['model']:<12} {ranks} b{r['batch']}: step {r['step_ms']:.3f} ms{versus}  roofline "
               f"{fmt(r['roofline_ms'], '.3f')}  eff {fmt(r['efficiency'])}  compiled graph "
               f"{fmt(r.get('cudagraph_compiled_ms'))} (x{fmt(r.get('speedup_vs_compiled'))})  graph "
               f"{fmt(r['cudagraph_ms'])} (x{fmt(r['speedup_vs_cudagraph'])})  hf {fmt(r['hf_eager_ms'], '.1f')}  "
               f"allreduce {fmt(r.get('allreduce_us'), '.1f')} us  peer wait {fmt(r.get('peer_wait_fraction'), '.3f')}")


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# the README's headline runs: each model's ring-kernel decode at batch 1 and 8, tp=1, from one results folder
HEADLINE = (("llama-3-8b", "h200-2026-12-03-271c8a2"), ("qwen3-8b", "h200-2026-12-03-271c8a2"),
            ("qwen3-30b-a3b", "h200-2026-12-03-400e158"), ("mixtral-8x7b", "h200-2026-12-03-400e158"))


def table(columns, rows) -> str:
    """A markdown table: a header of `columns`, then each row's cells."""
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns),
                      *("| " + " | ".join(map(str, row)) + " |" for row in rows)])


def load(folder: str, name: str) -> dict | list:
    with open(os.path.join(RESULTS, folder, name)) as f:
        return json.load(f)


def headline_table() -> str:
    """README.md's table: per model and batch the step, the speed-up over the compiled graph (its step) and the
    fraction of the roofline."""
    def cell(r):
        return (f"{r['step_ms']:.2f} ms, **{r['speedup_vs_compiled']:.2f}x** ({r['cudagraph_compiled_ms']:.2f} ms), "
                f"{r['efficiency']:.2f}")
    return table(["model", "batch 1", "batch 8", "results"],
                 [[model, *(cell(load(folder, f"decode_ring_{model}_b{b}_tp1.json")) for b in (1, 8)),
                   f"[{folder}](benchmarks/results/{folder})"] for model, folder in HEADLINE])


DECODE_COLUMNS = ["model", "batch", "distmk", "roofline", "efficiency", "torch.compile'd CUDA graph",
                  "plain CUDA graph"]
MODEL_ORDER = ("llama-3-8b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b")
# a run whose table shows a variant's JSON for a model (decode_ring_<variant>_<model>_...), as its README says
DECODE_VARIANTS = {"h200-2026-12-03-7286695": {"qwen3-30b-a3b": "keys2_"}}


def step_cells(r: dict) -> list[str]:
    """A decode record's step, roofline, efficiency and compiled graph (the speed-up over it in bold)."""
    return [f"{r['step_ms']:.2f} ms", f"{r['roofline_ms']:.2f} ms", f"{r['efficiency']:.2f}",
            f"{r['cudagraph_compiled_ms']:.2f} ms (**{r['speedup_vs_compiled']:.2f}x**)"]


def decode_runs(folder: str) -> list[dict]:
    """A run's tp=1 decode records, by model and batch: its ring kernel's where it timed the ring (a variant's JSON,
    named otherwise, only where DECODE_VARIANTS names it)."""
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(RESULTS, folder, "decode_*.json")))
    kernel = "_ring" if any(name.startswith("decode_ring_") for name in names) else ""
    variant = DECODE_VARIANTS.get(folder, {})
    runs = [r for name, r in zip(names, (load(folder, name) for name in names))
            if name == f"decode{kernel}_{variant.get(r['model'], '')}{r['model']}_b{r['batch']}_tp{r['tp']}.json"]
    order = lambda r: (MODEL_ORDER.index(r["model"]) if r["model"] in MODEL_ORDER else len(MODEL_ORDER), r["model"],
                       r["batch"])
    return sorted(runs, key=order)


def decode_table(folder: str, against: str | None = None) -> str:
    """A run's decode steps against the roofline and the compiled and plain CUDA graphs; with `against` (another
    run's folder), a last column of that run's step and speed-up, headed by its commit."""
    earlier = {(r["model"], r["batch"]): r for r in decode_runs(against)} if against else {}
    rows = []
    for r in decode_runs(folder):
        row = [r["model"], r["batch"], *step_cells(r), f"{r['cudagraph_ms']:.2f} ms"]
        if against:
            e = earlier[r["model"], r["batch"]]
            row.append(f"{e['step_ms']:.2f} ms ({e['speedup_vs_compiled']:.2f}x)")
        rows.append(row)
    return table(DECODE_COLUMNS + ([against.rsplit("-", 1)[1]] if against else []), rows)


def kernels_table(*runs: str) -> str:
    """Batch-1 steps of llama-3-8b and qwen3-8b by kernel, each run "FOLDER:KERNEL:LABEL" (ring or tl; the label
    names the code that ran)."""
    rows = []
    for model in ("llama-3-8b", "qwen3-8b"):
        for folder, kernel, label in (run.split(":") for run in runs):
            r = load(folder, f"decode{'_ring' if kernel == 'ring' else ''}_{model}_b1_tp1.json")
            rows.append([model, f"{kernel} ({label})", *step_cells(r),
                         f"{r['cudagraph_ms']:.2f} ms ({r['speedup_vs_cudagraph']:.2f}x)"])
    return table(["model", "kernel", *DECODE_COLUMNS[2:]], rows)


def fp8_table(folder: str) -> str:
    """A run's FP8-twin decode steps (decode.py --quantize fp8, decode_<model>_b<batch>_fp8.json): the e4m3 step
    against distmk's bf16 step of the same process, the FP8 roofline, and the compiled FP8 (weight-only and W8A8) and
    bf16 graphs where the run timed them."""
    runs = [load(folder, os.path.basename(p)) for p in glob.glob(os.path.join(RESULTS, folder, "decode_*_fp8.json"))]
    order = lambda r: (MODEL_ORDER.index(r["model"]) if r["model"] in MODEL_ORDER else len(MODEL_ORDER), r["batch"])
    rows = [[r["model"], r["batch"], f"**{r['step_ms']:.3f} ms**", f"{r['bf16_step_ms']:.3f} ms",
             f"{r['step_ms'] / r['bf16_step_ms']:.3f}", f"{r['roofline_ms']:.3f} ms", f"{r['efficiency']:.2f}",
             fmt(r.get("cudagraph_compiled_fp8_ms"), ".3f"), fmt(r.get("cudagraph_compiled_w8a8_ms"), ".3f"),
             fmt(r.get("cudagraph_compiled_ms"), ".3f")]
            for r in sorted(runs, key=order)]
    return table(["model", "batch", "e4m3 products", "bf16, same process", "x bf16", "FP8 roofline", "efficiency",
                  "compiled FP8 graph (weight-only)", "compiled FP8 graph (W8A8)", "compiled bf16 graph"], rows)


def tp_table(folder: str) -> str:
    """A tensor-parallel run's decode steps at tp 1 and 2, against the plain CUDA graph and transformers."""
    runs = [load(folder, os.path.basename(p)) for p in glob.glob(os.path.join(RESULTS, folder, "decode_*.json"))]
    order = ("llama-3-8b", "qwen3-8b", "llama-3.2-1b")
    rows = [[r["model"], r["tp"], r["batch"], f"**{r['step_ms']:.2f} ms**",
             f"{r['roofline_ms']:.2f} ms{' per rank' if r['tp'] > 1 else ''}", f"{r['efficiency']:.2f}",
             f"{r['cudagraph_ms']:.2f} ms ({r['speedup_vs_cudagraph']:.2f}x)",
             f"{r['hf_eager_ms']:.1f} ms ({r['speedup_vs_hf']:.1f}x)" if r["hf_eager_ms"] else ""]
            for r in sorted(runs, key=lambda r: (order.index(r["model"]), r["tp"], r["batch"]))]
    return table(["model", "tp", "batch", "distmk", "roofline", "efficiency",
                  "plain CUDA graph of PyTorch ops (+NCCL), not the yardstick", "transformers eager"], rows)


def allreduce_table(folder: str) -> str:
    """All-reduce latency (us) by message size: distmk's two transports, NCCL eager and graphed, symmetric memory."""
    rows = [[f"{r['bytes'] // 1024} KB" if r["bytes"] < 1 << 20 else f"{r['bytes'] >> 20} MB",
             *(f"{r[k]:.1f}" for k in ("distmk_us", "distmk_nvshmem_us", "nccl_eager_us", "nccl_graph_us",
                                       "symm_mem_us"))] for r in load(folder, "allreduce_tp2.json")]
    return table(["bytes", "distmk, peer pointers", "distmk, NVSHMEM put-signal", "NCCL eager", "NCCL in a CUDA graph",
                  "torch symm-mem one-shot"], rows)


def overlap_table(folder: str) -> str:
    """overlap.py's runs: µs a layer of the o_proj tiles alone and with their all-reduce, by tp."""
    paths = glob.glob(os.path.join(RESULTS, folder, "overlap_*.json"))
    runs = sorted((load(folder, os.path.basename(p)) for p in paths), key=lambda r: r["world"])
    rows = [[f"{r['world']} ({r['launcher']})", f"{r['gemv_us']:.2f}", f"{r['fused_us']:.2f}",
             f"**{r['fused_over_gemv']:.2f}**", fmt(r["cublas_us"]), fmt(r["cublas_nccl_us"])] for r in runs]
    return table(["tp", "o_proj tiles alone", "with their all-reduce", "x", "cuBLAS", "cuBLAS + NCCL"], rows)


def probe_table(folder: str) -> str:
    """stream.py's stacked-layer probe: each kernel and tile shape, without and with a barrier between layers."""
    rows = {}
    for r in load(folder, "stream_probe.json")["ring"]:
        key = (r["kernel"], r["rows"], r["block_n"], r["block_k"], r["stages"], r["x_stages"])
        rows.setdefault(key, [*key, "", "", f"{r['relative_error']:.1e}"])
        rows[key][7 if r["barrier"] else 6] = f"{r['gbps']:.0f} GB/s, {r['us_per_layer']:.2f} us"
    return table(["kernel", "rows a worker", "BN", "BK", "slots", "input slices", "no barrier", "barrier",
                  "error"], list(rows.values()))


def serve_table(folder: str, model: str = "llama-3-8b") -> str:
    """The server's latencies and throughput by tp (serve_load.py)."""
    runs = [load(folder, os.path.basename(p))
            for p in sorted(glob.glob(os.path.join(RESULTS, folder, f"serve_load_{model}_tp*.json")))]
    rows = [[r["tp"], f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f} s",
             f"{r['itl_s']['p50'] * 1e3:.1f} / {r['itl_s']['p99'] * 1e3:.1f} ms",
             f"{r['output_token_throughput_per_s']:.0f}"] for r in runs]
    return table(["tp", "TTFT p50 / p99", "inter-token p50 / p99", "output tokens/s"], rows)


# the tables a page makes from its runs' JSON: `<!-- table: KIND ARGS -->` on the line before each
TABLES = {"headline": headline_table, "decode": decode_table, "kernels": kernels_table, "tp": tp_table,
          "fp8": fp8_table, "allreduce": allreduce_table, "overlap": overlap_table, "probe": probe_table,
          "serve": serve_table}
MARKER = re.compile(r"^<!-- table: (\w+)((?: \S+)*) -->$")


def page_tables(text: str):
    """(marker, the table after it in `text`, the table its JSON makes) for each marked table of a page."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        found = MARKER.match(line)
        if found:
            end = next(j for j in range(i + 1, len(lines) + 1) if j == len(lines) or not lines[j].startswith("|"))
            yield line, "\n".join(lines[i + 1:end]), TABLES[found.group(1)](*found.group(2).split())


def main(folder: str) -> None:
    files = lambda pattern: sorted(glob.glob(os.path.join(folder, pattern)))
    for path in files("gpu_tests_*.log"):
        lines = [line for line in open(path) if line.strip()]
        print(f"{os.path.basename(path)}: {lines[-1].strip() if lines else 'empty'}")
    decode = [json.load(open(p)) for p in files("decode_*.json")]
    scaling = files("scaling/scaling.json")
    if scaling:
        decode += json.load(open(scaling[0]))
    for row in decode_rows(decode):
        print(row)
    for path in files("allreduce_*.json"):
        for r in json.load(open(path)):
            print(f"allreduce {r['bytes'] // 1024:>5} KB: pointer {fmt(r['distmk_us'], '.1f')}  nvshmem "
                  f"{fmt(r.get('distmk_nvshmem_us'), '.1f')}  nccl {fmt(r['nccl_eager_us'], '.1f')}  nccl graph "
                  f"{fmt(r['nccl_graph_us'], '.1f')}  symm-mem {fmt(r['symm_mem_us'], '.1f')} us")
    for path in files("overlap_*.json"):
        r = json.load(open(path))
        print(f"overlap {r.get('launcher', 'torchrun')} tp{r['world']}: gemv {r['gemv_us']:.2f}  fused "
              f"{r['fused_us']:.2f} (x{r['fused_over_gemv']:.2f})  cublas {fmt(r['cublas_us'], '.2f')}  cublas+nccl "
              f"{fmt(r['cublas_nccl_us'], '.2f')} us/layer")
    for path in files("serve_load_*.json"):
        r = json.load(open(path))
        print(f"serve {r['model']} tp{r['tp']}: {r['completed']}/{r['requests']} done, ttft p50 "
              f"{fmt(r['ttft_s']['p50'], '.3f')} s, itl p50 {fmt(r['itl_s']['p50'], '.4f')} p99 "
              f"{fmt(r['itl_s']['p99'], '.4f')} s, {r['output_token_throughput_per_s']} tok/s")
    for path in files("startup_*.jsonl"):
        for line in open(path):
            r = json.loads(line)
            outcome = "to the first token" if r["generate"] else "(generate failed: see its log)"
            print(f"start-up {r['run']}: {r['process_to_first_token_s']} s {outcome}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:        # --table KIND ARGS...: one of a page's tables (TABLES)
        print(TABLES[sys.argv[2]](*sys.argv[3:]))
    else:
        main(sys.argv[1])
