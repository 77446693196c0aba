"""How fast the matmul tasks stream weights, apart from the rest of the decode step; one JSON object.

    python benchmarks/stream.py --model llama-3-8b --json --out benchmarks/results/x/stream.json

Measured in one process on one GPU:
1. the read ceiling: the streaming-read kernel of decode.py's roofline;
2. the megakernel itself running only the step's matmul tasks (qkv, o_proj, gate_up, down) of --layers layers,
   the same tiles and code: first with no waits at all ("free"), then with a full barrier between
   phases as the step has them ("phases": each phase waits for every task of the one before); GB/s
   overall, and per task type from a traced run: a tile's weight bytes over its running time, per worker and
   as if every worker streamed at that rate;
3. the same two tables through the weight ring (ring_probe.py on distmk/device/ring.py, Gluon: a TMA producer warp fills a
   shared-memory ring from the worker's queue while the consumer waits on events and computes; the
   matmuls' epilogues aside), after a one-layer check against torch;
4. the ring against its plain-`tl` twin over 32 stacked layer matrices, with and without a full-grid
   barrier between layers: what a phase boundary costs each. On fewer programs than SMs (--probe-programs),
   HBM no longer bounds them: a loop's own rate an SM, which the step needs above HBM's share of an SM.
A try takes seconds: this is where the matmul path is iterated on, not in full decode runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys

import numpy as np
import torch
import triton

from baselines import measure_hbm_read_bandwidth
from decode import emit, git_commit
from distmk.flags import COUNT, NON_NEGATIVE
from distmk.timing import kernel_ms

MATMULS = ("qkv", "o_proj", "gate_up", "down")     # a layer's phases, in step order
PROBE_KERNELS = ("tl", "gluon", "gluon-fp8", "gluon-fp8-2wg", "gluon-w8a8")     # the stacked-layer probe's (run_ring)
E4M3_KERNELS = ("gluon-fp8", "gluon-fp8-2wg", "gluon-w8a8")                      # of them, those of e4m3 weights
PROBE_ROWS = (32, 64, 128)                                      # and its rows a worker
PROBE_K = 4096          # the probe's layers' columns: each reads the one before's outputs, so it has at least as many


def kernel_list(text: str) -> list[str]:
    kernels = text.split(",")
    unknown = [k for k in kernels if k not in PROBE_KERNELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown probe kernels {unknown}: use {', '.join(PROBE_KERNELS)}")
    return kernels


def rows_list(text: str) -> list[int]:
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rows must be integers, got {text!r}") from None
    if any(r not in PROBE_ROWS for r in rows):
        raise argparse.ArgumentTypeError(f"rows must be 32, 64 or 128, got {text!r}")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3-8b", help="preset name or Hugging Face checkpoint directory")
    p.add_argument("--batch", type=COUNT, default=1, help="rows per step")
    p.add_argument("--layers", type=NON_NEGATIVE, default=0, help="layers whose matmul tasks run (0: all)")
    p.add_argument("--iters", type=COUNT, default=50, help="timed launches per measurement")
    p.add_argument("--options", default='{"prefetch_kb": 0}',
                   help='megakernel options as JSON (given options skip autotuning), e.g. {"num_stages": 5}')
    p.add_argument("--no-ring", action="store_true", help="skip both weight-ring measurements (3. and 4.)")
    p.add_argument("--no-probe", action="store_true", help="skip the stacked-layer probe (4.)")
    p.add_argument("--probe-only", action="store_true", help="the stacked-layer probe (4.) alone")
    p.add_argument("--probe-kernels", type=kernel_list, default=list(PROBE_KERNELS), metavar="K,K",
                   help=f"the probe's kernels, of {','.join(PROBE_KERNELS)} (default: all)")
    p.add_argument("--probe-rows", type=rows_list, default=list(PROBE_ROWS), metavar="R,R",
                   help="the probe's rows a worker, of 32, 64 and 128 (default: all)")
    p.add_argument("--probe-pad", type=int, choices=(8, 16), default=16,
                   help="the probe's padded batch (the wgmma N): the megakernel's is 8 for batches up to 8 and 16 "
                        "above; the tl twin needs 16 (default 16)")
    p.add_argument("--probe-programs", type=NON_NEGATIVE, default=0,
                   help="the probe's programs, one an SM (0: every SM): fewer, and HBM no longer bounds what each "
                        "moves, so its GB/s a program is its loop's own rate")
    p.add_argument("--json", action="store_true", help="print the JSON on one line (default: indented)")
    p.add_argument("--out", help="also write the JSON to this file")
    return p.parse_args(argv)


def matmul_table(table, layers: int, phases: bool):
    """The step's matmul tasks of the first `layers` layers, rescheduled over the same workers: with no events
    at all, or each phase waiting for all of the previous one (a layer's qkv waits for the last down)."""
    from distmk.graph.scheduler import schedule
    from distmk.graph.table import LAYER, SIGNAL, TYPE, WAIT
    from distmk.tasks import TYPE_ID
    types = table.tasks[:, TYPE].tolist()
    keep = [t for t, kind in enumerate(types)
            if kind in [TYPE_ID[m] for m in MATMULS] and int(table.tasks[t, LAYER]) < layers]
    tasks = table.tasks[keep].clone()
    phase = torch.tensor([int(tasks[i, LAYER]) * len(MATMULS) + MATMULS.index(_name(tasks[i, TYPE]))
                          for i in range(len(keep))])
    order = torch.argsort(phase, stable=True)          # emission order = phase order, a topological order
    tasks, phase = tasks[order], phase[order]
    num_phases = int(phase.max()) + 1
    if phases:
        tasks[:, SIGNAL] = phase.to(torch.int32)
        tasks[:, WAIT] = (phase - 1).to(torch.int32)      # the first phase waits on nothing (-1)
        need = torch.bincount(phase, minlength=num_phases).to(torch.int32)
    else:
        tasks[:, WAIT] = -1
        tasks[:, SIGNAL] = -1
        need = torch.ones(1, dtype=torch.int32)
    names = [f"phase{p}" for p in range(len(need))]
    return schedule(tasks, need, table.cost[keep][order], names, table.config)


def weight_bytes(table, engine) -> torch.Tensor:
    """Bytes of weights each matmul task of `table` reads (the activations it reads come from L2)."""
    from distmk.graph.table import A1, TYPE
    spec, plan, size = engine.spec, engine.plan, engine.dtype.itemsize
    per_row = {"qkv": spec.hidden_size, "o_proj": plan.num_heads * spec.head_dim,
               "gate_up": 2 * spec.hidden_size, "down": plan.inter}      # gate_up: two matrices
    return torch.tensor([rows * per_row[_name(t)] * size for t, rows in table.tasks[:, [TYPE, A1]].tolist()],
                        dtype=torch.float64)


def _name(type_id) -> str:
    from distmk.tasks import TASK_KINDS
    return TASK_KINDS[int(type_id)].name


def run_megakernel(engine, table, iters: int, workers: int) -> dict:
    """GB/s of `table` in the megakernel (graph replays) and, from a traced launch, per task type."""
    from distmk.graph.table import TYPE
    from distmk.kernels.autotune import launch_times
    from distmk.kernels.executor import TritonExecutor
    options = {k: v for k, v in engine.executor.options.as_dict().items() if k != "trace"}

    def executor(trace):
        ex = TritonExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype,
                            **{**options, "trace": trace, "cuda_graph": not trace})
        ex.set_inputs(np.zeros((engine.config.batch, 2 + ex.block_table.shape[1]), dtype=np.int64))
        return ex

    timed = executor(False)
    ms = statistics.median(launch_times(timed, iters, warmup=5))
    del timed
    traced = executor(True)
    for _ in range(3):
        traced.launch()
    traced.check()
    timings = traced.timings()
    run_ns = (timings[:, 2] - timings[:, 1]).double()
    tile_bytes = weight_bytes(table, engine)
    total = int(tile_bytes.sum())
    per_type = {}
    for kind in MATMULS:
        rows = [t for t, k in enumerate(table.tasks[:, TYPE].tolist()) if _name(k) == kind]
        if rows:
            nbytes, ns = float(tile_bytes[rows].sum()), float(run_ns[rows].sum())
            per_type[kind] = {"tasks": len(rows), "tile_bytes": nbytes / len(rows), "tile_us": ns / len(rows) / 1e3,
                              "gbps_per_worker": nbytes / ns, "gbps_all_workers": nbytes / ns * workers}
    span = int(timings[:, 2].max() - timings[:, 0].min())
    return {"ms": ms, "bytes": total, "gbps": total / ms / 1e6, "traced_span_ms": span / 1e6,  # weight bytes
            "wait_fraction": float((timings[:, 1] - timings[:, 0]).sum()) / (span * workers), "per_type": per_type}


def ring_matmuls_runner(engine, b_pad: int = 16, block_k: int = 256, stages: int = 4, x_stages: int = 4):
    """A function that runs a matmul table through ring_probe.ring_matmuls over the engine's own
    weights (random inputs), returning its outputs; the launch zeroes the event counters first."""
    import ring_probe as ring
    from distmk.kernels.layout import stack_layers
    from distmk.tasks import TYPE_ID
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    spec, plan, device = engine.spec, engine.plan, engine.device
    stacked = stack_layers(engine.weights)
    w_layout, x_layout = ring.matmul_layouts(block_k, b_pad)
    weights = [TensorDescriptor.from_tensor(stacked[name].view(-1, stacked[name].shape[-1]), [16, 64], w_layout)
               for name in ("wqkv", "wo", "w_gate", "w_up", "w_down")]
    # the inputs of qkv and gate_up, of o_proj, of down
    inputs = [torch.randn(b_pad, k, device=device, dtype=torch.bfloat16)
              for k in (spec.hidden_size, plan.num_heads * spec.head_dim, plan.inter)]
    x_descs = [TensorDescriptor.from_tensor(x, [b_pad, block_k], x_layout) for x in inputs]
    rows_qkv = (plan.num_heads + 2 * plan.num_kv_heads) * spec.head_dim
    outs = {name: torch.zeros(b_pad, cols, device=device) for name, cols in
            (("qkv", rows_qkv), ("o_proj", spec.hidden_size), ("gate_up", 2 * plan.inter), ("down", spec.hidden_size))}
    rows = torch.full((1,), engine.config.batch, dtype=torch.int32, device=device)
    ids = {f"{name.upper()}_ID": TYPE_ID[kind] for name, kind in
           (("qkv", "qkv"), ("oproj", "o_proj"), ("gateup", "gate_up"), ("down", "down"))}

    def run(table):
        t = table.to(device)
        counters = torch.zeros(len(table.event_need), dtype=torch.int64, device=device)

        def launch():
            counters.zero_()
            ring.ring_matmuls[(table.num_workers,)](
                t.tasks, t.queue, t.queue_ptr, t.event_need, counters, rows, *weights, *x_descs, *outs.values(),
                spec.hidden_size, spec.head_dim, plan.num_heads, plan.num_kv_heads, plan.inter, 64, stages, x_stages,
                **ids, num_warps=4)
        return launch

    def expected(layer: int = 0):
        """What the matmul tasks of `layer` write, in float32."""
        lw = engine.weights.layer(layer)
        xh, xa, xi = (x.float() for x in inputs)
        n = engine.config.batch
        return {"qkv": xh[:n] @ lw.wqkv.float().t(), "o_proj": xa[:n] @ lw.wo.float().t(),
                "gate_up": torch.cat([xh[:n] @ lw.w_gate.float().t(), xh[:n] @ lw.w_up.float().t()], dim=1),
                "down": xi[:n] @ lw.w_down.float().t()}
    return run, outs, expected


def run_ring_matmuls(engine, tables: dict, ceiling: float, iters: int, layers: int, log) -> dict:
    """The step's matmul tables (by mode: free, phases) through the weight ring; first a one-layer table
    checked against torch."""
    run, outs, expected = ring_matmuls_runner(engine)
    run(matmul_table(engine.table, 1, phases=False))()
    torch.cuda.synchronize()
    n = engine.config.batch
    errors = {k: float(((outs[k][:n] - v).abs().max() / v.abs().max())) for k, v in expected().items()}
    log(f"ring matmuls, one layer against torch: relative max error {errors}")
    result = {"relative_error": errors}
    for mode, table in tables.items():
        ms = kernel_ms(run(table), warmup_ms=5, rep_ms=max(20, iters))
        total = int(weight_bytes(table, engine).sum())
        result[mode] = {"ms": ms, "bytes": total, "gbps": total / ms / 1e6, "of_read": total / ms / 1e-3 / ceiling}
        log(f"ring matmuls of {layers} layers, {mode}: {ms:.3f} ms, {total / ms / 1e6:.0f} GB/s "
            f"({result[mode]['of_read']:.2f} of the read ceiling; includes zeroing the counters)")
    return result


def probe_shape_problem(programs: int, row_counts, kernels) -> str | None:
    """What makes the stacked-layer probe's layers of programs x rows outputs impossible, if anything: each layer
    reads the outputs of the one before as its PROBE_K inputs, and e4m3 weights come in blocks of 128 rows."""
    for rows in row_counts:
        n = programs * rows
        if n < PROBE_K:
            return (f"--probe-rows {rows} on {programs} programs: {n} outputs a layer, fewer than the {PROBE_K} "
                    f"inputs the next layer reads (at least {-(-PROBE_K // rows)} programs)")
        if n % 128 and set(kernels) & set(E4M3_KERNELS):
            return (f"--probe-rows {rows} on {programs} programs: {n} rows a layer, not whole 128-row blocks of "
                    f"e4m3 scales")
    return None


def run_ring(device, iters: int, log, kernels=PROBE_KERNELS, row_counts=PROBE_ROWS, b_pad: int = 16,
             programs: int = 0) -> list[dict]:
    """The weight ring against its tl twin over 32 layers of [programs * rows, 4096] bf16 (a program an SM, every SM
    unless `programs`: 2.2 GB at 64 rows on 132; 32 rows: half a slot's, as o_proj's and down's tiles at tp=1), and
    the ring over the same weights in e4m3 with 128 x 128 block scales (models/fp8.py): bf16 activations
    (gluon-fp8; gluon-fp8-2wg: on two consumer warpgroups, ring_probe.py ring_stream_2wg), or e4m3 ones with a scale
    a row and 128 columns (gluon-w8a8); barrier off and on; a few tile shapes
    each. Each Gluon configuration is checked against torch first (the e4m3 ones against the dequantized weights,
    W8A8's against quantize_activations' input too)."""
    import ring_probe as ring
    from distmk.device.ring import part_columns
    from distmk.models.fp8 import DEFAULT_BLOCK, dequantize, in_block_order, quantize, quantize_activations
    programs = programs or torch.cuda.get_device_properties(device).multi_processor_count
    layers, k = 32, PROBE_K
    results = []
    for rows in row_counts:
        n = programs * rows
        w = torch.randn(layers * n, k, device=device, dtype=torch.bfloat16)
        w8, w_scale = quantize(w)
        y = torch.randn(2, b_pad, n, device=device, dtype=torch.bfloat16) * 0.1
        counters = torch.zeros(layers, device=device, dtype=torch.int32)
        # the tl twin stores whole blocks: rows it does not own otherwise; the ring masks a short block
        configs = [("tl", 64, 256, 4, 0), ("tl", 64, 128, 6, 0)] if rows % 64 == 0 and b_pad == 16 else []
        configs += [("gluon", bn, bk, stages, xd) for bn, bk, stages, xd in
                    ((64, 256, 4, 3), (64, 256, 4, 4), (64, 128, 8, 4), (64, 128, 8, 6), (128, 128, 6, 4))
                    if rows % bn == 0 or rows < bn]
        # e4m3 slots are 16 KB; input slices of 256 columns are what the megakernel reads
        configs += [(kernel, 64, bk, stages, xd) for kernel in ("gluon-fp8", "gluon-w8a8")
                    for bk, stages, xd in ((128, 10, 4), (256, 9, 4), (256, 10, 3))]
        # W8A16 on two consumer warpgroups: whole 64-row blocks, slices of two 128-column parts
        configs += [("gluon-fp8-2wg", 64, 256, stages, xd) for stages, xd in ((9, 6), (6, 6)) if rows % 64 == 0]
        configs = [config for config in configs if config[0] in kernels]
        for kernel, bn, bk, stages, xd in configs:
            e4m3 = kernel in E4M3_KERNELS
            weights = w8 if e4m3 else w
            if kernel in ("gluon-fp8", "gluon-fp8-2wg"):       # W8A16 loads each 128 columns in the ring's order
                weights = in_block_order(w8.view(torch.uint8), torch.tensor(part_columns(), device=device))
                weights = weights.view(w8.dtype)
            nbytes = weights.numel() * weights.element_size() + (w_scale.numel() * 4 if e4m3 else 0)
            if kernel == "tl":
                def launch(layer_count, mode):
                    ring.tl_stream[(programs,)](weights, y, counters, layer_count, rows, n, k, bn, bk, b_pad,
                                                programs, stages, mode, num_warps=4)
            else:
                w_desc, x_desc = ring.stream_descriptors(weights, y, bn, bk, b_pad)

                kernel_fn = ring.ring_stream_2wg if kernel == "gluon-fp8-2wg" else ring.ring_stream

                def launch(layer_count, mode):
                    kernel_fn[(programs,)](w_desc, x_desc, y, w_scale, counters, layer_count, rows, n, k, stages, xd,
                                           programs, mode, kernel == "gluon-w8a8", num_warps=4)
            y.copy_(torch.randn_like(y) * 0.1)
            before = y.clone()
            launch(1, 0)
            first = dequantize(w8[:n], w_scale[:n // DEFAULT_BLOCK[0]], DEFAULT_BLOCK) if e4m3 else w[:n].float()
            x = before[0].float()[:, :k]
            x = quantize_activations(x) if kernel == "gluon-w8a8" else x
            expected = x @ first.t() * ring.STREAM_SCALE.value
            error = float((y[1].float() - expected).abs().max() / expected.abs().max())
            for mode in (0, 1):
                def step():
                    counters.zero_()
                    launch(layers, mode)
                ms = kernel_ms(step, warmup_ms=5, rep_ms=max(20, iters))
                row = {"kernel": kernel, "rows": rows, "batch_pad": b_pad, "block_n": bn, "block_k": bk,
                       "stages": stages, "x_stages": xd, "barrier": bool(mode), "programs": programs,
                       "gbps": nbytes / ms / 1e6, "gbps_per_program": nbytes / ms / 1e6 / programs,
                       "us_per_layer": ms * 1e3 / layers, "relative_error": error}
                results.append(row)
                log(f"ring {kernel:9s} rows {rows} pad {b_pad} BN {bn} BK {bk} stages {stages} x {xd} barrier {mode}: "
                    f"{row['gbps']:.0f} GB/s ({row['gbps_per_program']:.1f} a program of {programs}), "
                    f"{row['us_per_layer']:.2f} us/layer (error {error:.1e})")
        del w, w8
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(f"[stream] {msg}", file=sys.stderr, flush=True)

    if not torch.cuda.is_available():
        log("no CUDA GPU is visible: stream.py measures GPU kernels")
        return 2
    from harness import decode_engine
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if args.probe_programs > sms:
        log(f"--probe-programs {args.probe_programs}: this GPU has {sms} SMs")
        return 2
    if args.probe_only or not (args.no_ring or args.no_probe):
        problem = probe_shape_problem(args.probe_programs or sms, args.probe_rows, args.probe_kernels)
        if problem:
            log(problem)
            return 2
    result = {"model": args.model, "batch": args.batch}
    ceiling = measure_hbm_read_bandwidth(device)
    result["read_gbps"] = ceiling / 1e9
    log(f"read ceiling {ceiling / 1e9:.0f} GB/s")
    if args.probe_only:
        result["ring"] = run_ring(device, args.iters, log, args.probe_kernels, args.probe_rows, args.probe_pad,
                                  args.probe_programs)
        return emit_result(result, args)
    engine = decode_engine(args.model, args.batch, 512, **json.loads(args.options))
    layers = args.layers or engine.spec.num_layers
    workers = engine.table.num_workers
    result.update(layers=layers, workers=workers, options=engine.executor.options.as_dict())
    tables = {mode: matmul_table(engine.table, layers, phases=mode == "phases") for mode in ("free", "phases")}
    for mode, table in tables.items():
        figures = run_megakernel(engine, table, args.iters, workers)
        figures["of_read"] = figures["gbps"] * 1e9 / ceiling
        result[f"megakernel_{mode}"] = figures
        log(f"megakernel, matmul tasks of {layers} layers, {mode}: {figures['ms']:.3f} ms, {figures['gbps']:.0f} GB/s "
            f"({figures['of_read']:.2f} of the read ceiling), waits {figures['wait_fraction']:.1%} of worker time")
        for kind, f in figures["per_type"].items():
            log(f"  {kind:8s} {f['tasks']:5d} tiles of {f['tile_bytes'] / 1e6:.2f} MB in {f['tile_us']:.1f} us: "
                f"{f['gbps_per_worker']:.1f} GB/s per worker, {f['gbps_all_workers']:.0f} GB/s on all")
    if not args.no_ring:
        result["ring_matmuls"] = run_ring_matmuls(engine, tables, ceiling, args.iters, layers, log)
    del engine
    torch.cuda.empty_cache()
    if not (args.no_ring or args.no_probe):
        result["ring"] = run_ring(device, args.iters, log, args.probe_kernels, args.probe_rows, args.probe_pad,
                                  args.probe_programs)
    return emit_result(result, args)


def emit_result(result: dict, args) -> int:
    result.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=shlex.join(["python", *sys.argv]), distmk_commit=git_commit())
    emit(result, args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
