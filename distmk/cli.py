"""What the programs that build an Engine (distmk.generate, distmk.serve) share: the model and engine
flags, the communicator for the launch, and the Engine built from them, so both read flags alike."""
from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from distmk.comm import backend_comm
from distmk.comm.cpu import VIRTUAL_RANKS_ENV
from distmk.dist import LaunchEnv, init_process_group
from distmk.errors import DistmkError
from distmk.flags import COUNT, NON_NEGATIVE, SEED, float_in
from distmk.graph.flags import add_graph_args, graph_config
from distmk.graph.lowering import GraphConfig
from distmk.kernels.options import KernelOptions
from distmk.runtime.engine import DTYPES, Engine, device_fields


def step_batches(text: str) -> tuple[int, ...] | None:
    """An argparse type: 'auto' (None: powers of two below the step's rows), 'none', or comma-separated counts."""
    if text in ("auto", "none"):
        return None if text == "auto" else ()
    return tuple(COUNT(part) for part in text.split(","))


def powers_of_two_below(rows: int) -> tuple[int, ...]:
    return tuple(2 ** i for i in range(rows.bit_length()) if 2 ** i < rows)


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """KernelOptions' flags (the fields with a help), for the triton backend. Unset, an option takes its tuned
    value (kernels/autotune.py), else its default."""
    types = {"float": float_in(0, lo_open=True), "int": NON_NEGATIVE, "int | None": COUNT, "str": str}
    for f in dataclasses.fields(KernelOptions):
        if "help" in f.metadata:
            flag = "--" + (f.metadata["flag"] or f.name).replace("_", "-")
            p.add_argument(flag, dest=f.name, type=types[f.type], default=None, choices=f.metadata["choices"],
                           metavar=None if f.metadata["choices"] else flag[2:].upper().replace("-", "_"),
                           help=f"triton backend: {f.metadata['help']} (default: {f.default})")


def add_quantize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=["fp8"], default=None,
                   help="fp8: the layers' products' weights quantized at load to e4m3 in 128 x 128 blocks (the FP8 "
                        "twin of a bf16 checkpoint or preset; an FP8 checkpoint needs no flag)")


def kernel_options_of(args) -> dict:
    """The KernelOptions that add_kernel_args' flags set."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(KernelOptions)
            if "help" in f.metadata and getattr(args, f.name, None) is not None}


VIRTUAL_TP_HELP = ("run N tensor-parallel ranks as threads of this one process on one device, each rank with its "
                   "share of the GPU's SMs and every rank's buffers in its memory, exchanging through the peer-pointer "
                   "code that ranks of one node use: a test and measurement mode for tp > 1 where one GPU is at hand, "
                   "not a deployment (it is no faster than tp=1)")


def add_engine_args(p: argparse.ArgumentParser, batch_flag: str, batch_help: str,
                    step_batches_default: str = "auto") -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory or preset name")
    p.add_argument("--backend", choices=["reference", "triton"], default="reference")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument(batch_flag, dest="batch", type=COUNT, default=16, help=batch_help)
    p.add_argument("--max-context", type=COUNT, default=None,
                   help="tokens per sequence, prompt + output (default: the model's, at most 2048)")
    p.add_argument("--seed", type=SEED, default=0, help="seed of a preset's random weights")
    add_quantize_arg(p)
    p.add_argument("--step-batches", type=step_batches, default=step_batches(step_batches_default),
                   metavar="auto|none|B,B,...",
                   help=f"row counts of smaller step tables, compiled beside the full one: a step runs the smallest "
                        f"that holds its rows, so a lone stream's attention is split over every SM and rows that are "
                        f"not there cost nothing (auto: the powers of two below {batch_flag}; default "
                        f"{step_batches_default})")
    p.add_argument("--prefill-chunk", type=NON_NEGATIVE, default=512,
                   help="prompt tokens a prefill chunk takes, by matrix products rather than the decode steps' rows "
                        "(0: every prompt through the steps)")
    add_graph_args(p, f"one per SM with --device cuda, 1 under Triton's interpreter, else {GraphConfig.workers}")
    add_kernel_args(p)
    p.add_argument("--no-autotune", action="store_true",
                   help="triton backend: use the cached or default kernel options, measure nothing")
    p.add_argument("--virtual-tp", type=COUNT, default=1, metavar="N", help=VIRTUAL_TP_HELP)


def run_virtual_ranks(args, launch: LaunchEnv, fn, lead_here: bool = False) -> list:
    """fn(launch, comm) on each of --virtual-tp's ranks (threads, comm/cpu.py ThreadRanks; rank 0 on this one with
    `lead_here`), whose LaunchEnv says `virtual`; their results in rank order. Refused under a launcher of several
    ranks."""
    from distmk.comm.cpu import run_simulated_ranks
    if launch.world > 1:
        raise DistmkError(f"--virtual-tp runs its ranks in one process; {launch.launcher} started {launch.world}")
    n = args.virtual_tp
    # a rank may wait at a gather while its peers load and compile: an 8B model's ranks take minutes
    return run_simulated_ranks(n, lambda rank, comm: fn(LaunchEnv("virtual", rank, n, 0, 1, 1), comm), timeout=1800,
                               lead_here=lead_here)


def open_comm(args, launch: LaunchEnv):
    """None for one rank; torch.distributed for the reference backend; NVSHMEM for the megakernel."""
    if launch.world == 1:
        return None
    init_process_group(launch, "gloo" if args.device == "cpu" else "nccl")
    return backend_comm(args.backend, launch)


def select_device(args, launch: LaunchEnv) -> str:
    """This rank's device; on a GPU it becomes the current one (before NCCL or NVSHMEM start)."""
    if args.device == "cpu":
        return "cpu"
    if getattr(args, "virtual_tp", 1) > 1:
        for name, value in VIRTUAL_RANKS_ENV.items():
            os.environ.setdefault(name, value)
    if not torch.cuda.is_available():
        raise DistmkError("--device cuda: no CUDA device is visible")
    torch.cuda.set_device(launch.local_rank)
    return f"cuda:{launch.local_rank}"


def build_engine(args, launch: LaunchEnv, comm, device: str, *, progress: bool, max_seqs: int,
                 kernel_options: dict | None = None) -> Engine:
    """The Engine the flags describe, with KV-cache room for max_seqs sequences of the full context.
    kernel_options: extra options of the triton backend's executor."""
    dtype = DTYPES[args.dtype or ("float32" if args.device == "cpu" else "bfloat16")]
    config = graph_config(args, batch=args.batch, **device_fields(args.backend, device, args.workers,
                                                                  getattr(comm, "ranks_on_device", 1)))
    kernel_options = {**kernel_options_of(args), **(kernel_options or {})} if args.backend == "triton" else None
    return Engine(args.model, tp=launch.world, rank=launch.rank, comm=comm, dtype=dtype, device=device,
                  backend=args.backend, config=config, max_context=args.max_context, seed=args.seed,
                  progress=progress, kernel_options=kernel_options, autotune=not args.no_autotune,
                  max_seqs=max_seqs, prefill_chunk=args.prefill_chunk, quantize=args.quantize,
                  step_batches=powers_of_two_below(args.batch) if args.step_batches is None else args.step_batches)
