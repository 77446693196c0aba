"""TritonExecutor: runs a TaskTable in the persistent megakernel, one launch per step.

Step inputs live in static device buffers and the step counter (epoch) in device memory, so on a GPU the
epoch bump and the launch are captured once in a CUDA graph and each step is a replay. Every wait is
bounded: a worker that waits longer than `timeout_s` records who waited on what, all workers leave, and
step() raises WatchdogTimeout naming the task and the event.

What a step costs the host, and why. A step from the host with its tokens read back cost noticeably more than
a bare graph replay: it made four small kernels before the replay (copies of tokens, positions and block table
into the static buffers, a fill of the row count), which a persistent kernel that fills the GPU leaves idle
for several microseconds each, and two device-to-host round trips after it (the watchdog's error word, then
next_token). So now the kernel's inputs (tokens, positions, block table, row count) are views of one int64
device buffer, `inputs`, and its host outputs (error word, next_token) views of another, `outputs`: a step is
one non-blocking copy from the pinned host twin of `inputs`, the replay, and one copy of `outputs` into pinned
memory, its one sync (check). With nothing to copy inside the device, the graph holds only the epoch bump and
the launch. Back-to-back decode steps (Engine.decode, which had six small kernels between replays) replay a
second graph that first takes each row's token from next_token and moves its position on (step_next): no host
copy, one kernel left between replays (decode's clone of the tokens it returns). What this saves has not been
measured yet.
"""
from __future__ import annotations

import dataclasses
import math
import os
import threading

import numpy as np
import torch

from distmk.comm.cpu import VIRTUAL_RANKS_ENV
from distmk.errors import DistmkError
from distmk.graph.lowering import num_lm_tiles
from distmk.graph.table import SIGNAL, TYPE, WAIT
from distmk.kernels.layout import stack_layers
from distmk.kernels.interface import Launch, launch_arguments, padded
from distmk.kernels.megakernel import ERROR_FIELDS, TRACE_FIELDS, compile_ahead, load_megakernel
from distmk.kernels.options import KernelOptions
from distmk.kernels.ring_megakernel import load_ring_megakernel, ring_arguments, ring_unsupported
from distmk.tasks import TASK_KINDS
from distmk.tasks.base import rope_table
from distmk.graph.workspace import allocate_workspace


class WatchdogTimeout(DistmkError):
    """A task of the megakernel waited longer than the timeout for its event."""


def stalled_event(table, incomplete: torch.Tensor) -> int | None:
    """Where a step stalled: an incomplete event none of whose signalling tasks waits on an incomplete event
    (everything upstream arrived, yet it did not), as opposed to the events merely downstream of it; None where
    every event completed in the end (what was waited for came, later than the bound)."""
    wait, signal = table.tasks[:, WAIT].long(), table.tasks[:, SIGNAL].long()
    blocked = (wait >= 0) & incomplete[wait.clamp(min=0)]
    has_blocked_signaller = torch.zeros_like(incomplete)
    has_blocked_signaller[signal[(signal >= 0) & blocked]] = True
    roots = (incomplete & ~has_blocked_signaller).nonzero()
    return int(roots[0]) if len(roots) else None


TRANSPORTS = ("pointer", "nvshmem")     # the megakernel's TRANSPORT constant is the index
# row-parallel outputs whose exchanges may be in flight at once: a rank is at most one ahead (device/exchange.py)
EXCHANGE_SLOTS = 2


def choose_transport(requested: str, comm) -> str:
    """How exchange tasks reach peers: stores through peer pointers where every peer is reachable by one
    (one node), else NVSHMEM put-with-signal; `requested` forces one."""
    available = getattr(comm, "transports", ("pointer",))
    if requested == "auto":
        return "pointer" if "pointer" in available else "nvshmem"
    if requested not in TRANSPORTS:
        raise DistmkError(f"unknown transport {requested!r}: use auto, pointer or nvshmem")
    if requested not in available:
        raise DistmkError(f"the {requested} transport is not available with {type(comm).__name__} "
                          f"(available: {', '.join(available)})")
    return requested


KERNELS = ("auto", "ring", "tl")
STARTUP_TIMEOUT_S = 300     # the bound of a tensor-parallel executor's first launch (see TritonExecutor.first_launch)


def choose_kernel(requested: str, device, interpret: bool, unsupported: str | None) -> str:
    """Which megakernel runs the table: the weight ring (ring_megakernel.py: Gluon, wgmma, TMA) on a Hopper GPU
    where it supports the step, else the tl one (any CUDA GPU, Triton's interpreter, NVSHMEM's put-with-signal).
    `unsupported`: why the ring cannot run this step, or None. Asking for "ring" where it cannot run is an error;
    on the meta device it compiles ahead of time."""
    if requested not in KERNELS:
        raise DistmkError(f"unknown kernel {requested!r}: use auto, ring or tl")
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    if requested == "ring":
        if interpret or not (hopper or device.type == "meta"):
            raise DistmkError("the ring megakernel needs a Hopper GPU (sm_90) and runs no interpreter")
        if unsupported:
            raise DistmkError(f"the ring megakernel cannot run this step: {unsupported}")
        return "ring"
    return "ring" if requested == "auto" and hopper and not interpret and unsupported is None else "tl"


def packed(shapes, device, pin_memory: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One zeroed int64 buffer and views of it of `shapes`, so that one copy moves them all. Each view starts
    16 bytes aligned, as a separate allocation would: Triton specialises a pointer argument on that alignment."""
    sizes = [math.prod(shape) for shape in shapes]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + -(-size // 2) * 2)       # whole 16-byte units
    buffer = torch.zeros(starts[-1], dtype=torch.int64, device=device, pin_memory=pin_memory)
    return buffer, [buffer[start:start + size].view(shape) for start, size, shape in zip(starts, sizes, shapes)]


class SymmetricBuffers:
    """This rank's symmetric memory (every rank allocates the same, so peers address it): event counters that
    peers bump, exchange buffers of row-parallel partial sums and of the argmax, each with the peers' addresses
    (device/exchange.py, tasks/argmax_push.py)."""

    def __init__(self, comm, events: int, batch: int, hidden: int, device):
        b_pad = padded(batch)
        self.counters, self.counter_peers = comm.symmetric((events,), torch.int64, device)
        self.exchange, self.exchange_peers = comm.symmetric((EXCHANGE_SLOTS, comm.world, b_pad * hidden),
                                                            torch.float32, device)
        self.best, self.best_peers = comm.symmetric((comm.world, b_pad), torch.float32, device)
        self.best_id, self.best_id_peers = comm.symmetric((comm.world, b_pad), torch.int64, device)

    def arguments(self) -> dict:
        return dict(vars(self))


def prefetching_kinds(kinds: dict, names: str) -> dict:
    """The task types of `kinds` whose weights the tl kernel prefetches: those of the comma-separated `names`
    (KernelOptions.prefetch_tasks; empty: every type with a gpu_prefetch). At qwen3-30b-a3b batch 1 the QKV
    tiles' prefetch lost more than the o_proj tiles' won."""
    able = sorted(TASK_KINDS[t].name for t in range(len(TASK_KINDS)) if TASK_KINDS[t].gpu_prefetch is not None)
    wanted = {name.strip() for name in names.split(",") if name.strip()}
    if wanted - set(able):
        raise DistmkError(f"kernel option prefetch_tasks names {sorted(wanted - set(able))}: task types that "
                          f"prefetch are {able}")
    return {t: k for t, k in kinds.items() if k.gpu_prefetch is not None and (not wanted or k.name in wanted)}


class TritonExecutor:
    def __init__(self, table, spec, weights, kv_cache, comm, dtype, **options):
        """`options`: KernelOptions' fields."""
        o = KernelOptions.of(options)
        # the kernel holds the device code of the task types this table runs, no others: less code, and a dense
        # model's kernel without the experts' (on Triton 3.6 the expert gate/up tile at a dense model's constants,
        # no experts, failed the tl kernel's compile)
        kinds = {t: TASK_KINDS[t] for t in sorted(set(table.tasks[:, TYPE].tolist()))}
        missing = sorted(kind.name for kind in kinds.values() if kind.gpu is None)
        if missing:
            raise DistmkError(f"task types {missing} have no GPU implementation")
        prefetched = prefetching_kinds(kinds, o.prefetch_tasks)
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self.device = device = weights.embed.device
        if self.interpret and table.num_workers > 1:
            raise DistmkError("under TRITON_INTERPRET programs run one after another, so a table for "
                              f"{table.num_workers} workers would wait forever: compile it for workers=1")
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        sharing = getattr(comm, "ranks_on_device", 1)      # virtual ranks: every rank's kernel on this GPU at once
        unset = {k: v for k, v in VIRTUAL_RANKS_ENV.items() if os.environ.get(k) != v}
        if sms and sharing > 1 and unset:
            needed = " ".join(f"{k}={v}" for k, v in unset.items())
            raise DistmkError(f"{sharing} virtual ranks on one GPU need {needed} set before CUDA starts "
                              f"(comm/cpu.py VIRTUAL_RANKS_ENV says why)")
        if sms and table.num_workers * sharing > sms:
            ranks = f"{sharing} ranks x " if sharing > 1 else ""
            raise DistmkError(f"a table for {ranks}{table.num_workers} workers cannot run on {sms} SMs: every "
                              f"worker of the persistent kernel{'s' if sharing > 1 else ''} must be resident at "
                              f"once (set GraphConfig.workers to at most {sms // sharing})")
        if spec.head_dim & (spec.head_dim - 1):
            raise DistmkError(f"the triton backend needs a power-of-two head_dim, the model has {spec.head_dim}")
        config, plan = table.config, weights.plan
        if (spec.hidden_size | plan.inter) % 8:
            o = dataclasses.replace(o, prefetch_kb=0)       # bulk prefetch needs 16-byte aligned rows
        self.table, self.spec, self.plan, self.rank = table, spec, plan, comm.rank
        self.options = o
        self.dev_table = table.to(device)
        self.buf = allocate_workspace(spec, plan, config, dtype, device)
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        # The step's inputs and the outputs the host reads, each set a view of one buffer with a pinned host
        # twin (pinned: a non-blocking copy from it is a DMA the host does not wait for; see the docstring)
        pin = device.type == "cuda"
        inputs = ((config.batch,), (config.batch,), (config.batch, kv_cache.blocks_per_seq), (1,))
        self.inputs, (self.tokens, self.positions, self.block_table, rows) = packed(inputs, device)
        self.rows = rows.view(torch.int32)[:1]      # the kernel's int32 row count: the low word, little-endian
        self.host_inputs, host = packed(inputs, "cpu", pin)
        self.host_fields = [view.numpy() for view in host]
        self.inputs_copied = torch.cuda.Event() if pin else None    # the host twin may be rewritten after it
        outputs = ((len(ERROR_FIELDS),), (config.batch,))
        self.outputs, (self.error, self.buf["next_token"]) = packed(outputs, device)
        self.host_outputs, (self.host_error, self.host_next_token) = packed(outputs, "cpu", pin)
        self.epoch = torch.zeros(1, **i32)
        self.trace = torch.zeros(table.num_tasks if o.trace else 1, len(TRACE_FIELDS), **i64)
        self.symmetric = SymmetricBuffers(comm, len(table.event_need), config.batch, spec.hidden_size, device)
        self.transport = choose_transport(o.transport, comm)
        self.launch_options = dict(num_warps=o.num_warps, num_stages=1 if self.interpret else o.num_stages)
        signal_add = -1                         # only the NVSHMEM transport uses it
        if self.transport == "nvshmem":
            from distmk.device.nvshmem import extern_libs, signal_constants
            signal_add = signal_constants()["SIGNAL_ADD"]
            self.launch_options["extern_libs"] = extern_libs()
        launch = Launch(spec=spec, plan=plan, config=config, options=o, dtype=dtype, kv=kv_cache, world=comm.world,
                        rank=comm.rank, interpret=self.interpret, transport=TRANSPORTS.index(self.transport),
                        signal_add=signal_add, exchange_slots=EXCHANGE_SLOTS, lm_tiles=num_lm_tiles(plan, config),
                        peers_on_device=getattr(comm, "peers_on_device", False),
                        streams_e4m3=bool(weights.fp8),
                        # polls when interpreted: simulated ranks (threads) may have to wait for each other a while
                        timeout=(1000 if comm.world == 1 else 10 ** 6) if self.interpret else int(o.timeout_s * 1e6))
        control = dict(tasks=self.dev_table.tasks, queue=self.dev_table.queue, queue_ptr=self.dev_table.queue_ptr,
                       event_need=self.dev_table.event_need, epoch_ptr=self.epoch, rows_ptr=self.rows,
                       error=self.error, trace=self.trace)
        if kv_cache.rope is None:
            kv_cache.rope = rope_table(spec.inv_freq(), kv_cache.blocks_per_seq * kv_cache.block_size).to(device)
        tensors = dict(**stack_layers(weights), k_cache=kv_cache.k, v_cache=kv_cache.v, rope=kv_cache.rope,
                       tokens=self.tokens, positions=self.positions, block_table=self.block_table, **self.buf,
                       **self.symmetric.arguments())
        self.args = launch_arguments(launch, control, tensors)
        self.kernel_name = choose_kernel(o.kernel, device, self.interpret,
                                         ring_unsupported(spec, plan, config, dtype, self.transport,
                                                          set(kinds.values()), weights.fp8))
        # the ring loads e4m3 weights with each 128 columns in its operand's order, the tl kernel in their own
        self.weights, self.fp8_columns = weights, None
        if self.kernel_name == "ring":
            from distmk.device.ring import part_columns
            self.fp8_columns = part_columns()
            self.args = ring_arguments(self.args, config.batch, o.ring_block_k, o.ring_slots, o.ring_inputs,
                                       weights.fp8)
            self.launch_options = {}
            self.kernel = load_ring_megakernel(kinds)
        else:       # e4m3 products: dequantized as the tiles load them (device/primitives.py dequantized)
            self.args.update({name: values for name, (values, _) in weights.fp8.items()})
            if weights.fp8:     # their loads and conversions, pipelined 4 deep, overflow Hopper's shared memory
                self.launch_options["num_stages"] = min(self.launch_options["num_stages"], 3)
            self.kernel = load_megakernel(kinds, prefetched)
        weights.order_fp8(self.fp8_columns)     # in place: the arguments hold the same tensors
        self.fp8_order = weights.fp8_order
        if comm.world > 1:
            self._start_together(comm)
        self.use_graph = o.cuda_graph and device.type == "cuda"
        self.graphs = {}                        # by launch()'s `follow`
        # tp > 1: the first launch may wait for a peer still busy with what comes between the barrier and its own
        # first launch (its prefill, a graph capture), so its waits get STARTUP_TIMEOUT_S
        self.first_launch = comm.world > 1 and device.type == "cuda"
        self.comm_world, self.failed = comm.world, False

    def _start_together(self, comm) -> None:
        """tp > 1: check that every rank compiled the same table, compile, and meet at a barrier."""
        # Exchanges address events by id and buffers by shape: every rank must run the same table. The gather
        # also keeps every rank from pushing into a peer's buffers before the peer zeroed them.
        device, table = self.device, self.table
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        on = device if device.type == "cuda" else "cpu"       # NCCL gathers CUDA tensors; meta has no values
        digests = [int(d) for d in comm.gather(torch.tensor([table.digest()], dtype=torch.int64, device=on))]
        if len(set(digests)) > 1:
            raise DistmkError(f"tensor-parallel ranks compiled different task tables (digests {digests}): "
                              f"give every rank the same GraphConfig (workers, batch, tiles) and model")
        if device.type == "cuda":
            # Compile before the first step, then start together: a rank still compiling would leave its
            # peers' first exchange waiting past the watchdog, which is final at tp > 1.
            grid = (table.num_workers,)
            if self.transport == "nvshmem":
                from distmk.device.nvshmem import compile_for_nvshmem
                compile_for_nvshmem(self.kernel, grid, **self.args, **self.launch_options)
            else:       # loaded now, not at its first launch, which may find the peers' kernels running
                self.kernel.warmup(grid=grid, **self.args, **self.launch_options)._init_handles()
            comm.barrier()

    def _launch(self, follow: bool = False) -> None:
        if self.device.type != "cuda" and not self.interpret:
            raise DistmkError("the triton backend needs --device cuda (or TRITON_INTERPRET=1 on the CPU)")
        if follow:
            self.tokens.copy_(self.buf["next_token"])
            self.positions.add_(1)
        self.epoch += 1
        timeout = self.args["timeout"]
        if self.first_launch:
            self.first_launch = False
            self.args["timeout"] = max(timeout, int(STARTUP_TIMEOUT_S * 1e6))
        try:
            self.kernel[(self.table.num_workers,)](**self.args, **self.launch_options)
        finally:
            self.args["timeout"] = timeout

    def launch(self, follow: bool = False) -> None:
        """One step over the inputs set last (set_inputs), or with `follow` the next decode step of the rows the
        step before ran: each row's token the one it chose, at the next position. On a GPU a replay of the
        graph of that kind of step, captured on first use; before the first capture a plain launch compiles the
        kernel and runs the step once, outside the capture."""
        self._hold_fp8_order()
        if not self.use_graph:
            return self._launch(follow)
        if follow not in self.graphs:
            if not follow:
                self._launch()              # compile and warm up outside the capture
                self.check()
            self.graphs[follow] = self._capture(follow)
        self.graphs[follow].replay()

    def _hold_fp8_order(self) -> None:
        """Put the e4m3 columns back in this kernel's order where an executor of the other kernel on the same weights
        (a benchmark's second engine, a tl fallback) has since put them in its own, in place: a step would read
        them scrambled. An identity check a step; a full reorder only when the kernels alternate."""
        if self.weights.fp8 and self.weights.fp8_order is not self.fp8_order:
            self.weights.order_fp8(self.fp8_columns)
            self.fp8_order = self.weights.fp8_order

    _capturing = threading.Lock()

    def _capture(self, follow: bool):
        """The graph of one launch, recorded (not run) on a side stream of this rank's. Virtual ranks are threads
        that each capture while the others' kernels run: so no device-wide sync (torch.cuda.graph's), errors of
        this thread's capture alone, one capture at a time."""
        graph, current = torch.cuda.CUDAGraph(), torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with self._capturing, torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._launch(follow)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph

    def set_inputs(self, rows: np.ndarray) -> None:
        """The next launch's rows: int64 [rows, 2 + blocks] as runtime.engine.pack_rows lays them out (token,
        position, block table). Written into the pinned host twin of `inputs`, they reach the device in one
        non-blocking copy, ordered before the launch by the stream they share."""
        n = len(rows)
        if not 1 <= n <= self.tokens.shape[0]:
            raise DistmkError(f"a step takes 1..{self.tokens.shape[0]} rows, got {n}")
        if self.inputs_copied is not None:
            self.inputs_copied.synchronize()    # a step not waited for may not have copied the twin yet
        tokens, positions, block_table, count = self.host_fields
        tokens[:n], positions[:n], block_table[:n], count[0] = rows[:, 0], rows[:, 1], rows[:, 2:], n
        self.inputs.copy_(self.host_inputs, non_blocking=True)
        if self.inputs_copied is not None:
            self.inputs_copied.record(torch.cuda.current_stream(self.device))

    def step(self, tokens, positions, block_table, wait: bool = True) -> dict:
        """Run a step of len(tokens) rows (tensors on any device, or lists), as ReferenceExecutor.step takes
        them: packed on the host, then step_rows."""
        rows = np.zeros((len(tokens), 2 + self.block_table.shape[1]), dtype=np.int64)
        rows[:, 0], rows[:, 1], rows[:, 2:] = (torch.as_tensor(x).cpu() for x in (tokens, positions, block_table))
        return self.step_rows(rows, wait)

    def step_rows(self, rows: np.ndarray, wait: bool = True) -> dict:
        """Run a step of `rows` (see set_inputs); with wait, also wait for it and raise if a worker gave up (else
        the next step with wait does, for both)."""
        self.set_inputs(rows)
        return self._run(False, wait)

    def step_next(self, wait: bool = True) -> dict:
        """The next greedy decode step of the last step's rows, fed on the device (see launch's `follow`)."""
        return self._run(True, wait)

    def _run(self, follow: bool, wait: bool) -> dict:
        if self.failed:
            raise WatchdogTimeout("an earlier step timed out on this tensor-parallel rank: restart the job")
        self.launch(follow)
        if wait:
            self.check()
        return self.buf

    def next_tokens(self, n: int) -> list[int]:
        """The greedy tokens of the first n rows of the last step checked: check copied them to the host."""
        return self.host_next_token[:n].tolist()

    def check(self) -> None:
        """Raise WatchdogTimeout if a worker gave up waiting in the last launch. Waits for it: `outputs` (the error
        word, next_token) come to pinned memory in one copy, the step's one sync."""
        self.host_outputs.copy_(self.outputs)
        err = dict(zip(ERROR_FIELDS, self.host_error.tolist()))
        if not err["failed"]:
            return
        # one rank cannot restart its counters while peers still signal into them: tp>1 stays failed
        self.failed = self.comm_world > 1
        counters = self.symmetric.counters.to("cpu", copy=True)     # the device counters are reset below
        self.error.zero_()
        self.symmetric.counters.zero_()               # the aborted step left counters mid-way: start over
        self.buf["attn_count"].zero_()
        self.buf["route_arrivals"].zero_()
        self.epoch.zero_()
        targets = self.dev_table.event_need.long().cpu() * err["epoch"]
        root = stalled_event(self.table, counters.cpu() < targets)
        kind = TASK_KINDS[int(self.table.tasks[err["task"], TYPE])].name
        where = (f"the step stalled at event {root} '{self.table.event_names[root]}' at {int(counters[root])}/"
                 f"{int(targets[root])}" if root is not None else
                 "every event completed in the end: what it waited for came later than the bound")
        raise WatchdogTimeout(
            f"rank {err['rank']} worker {err['worker']}: task {err['task']} ({kind}) waited on event {err['event']} "
            f"'{self.table.event_names[err['event']]}' and gave up at counter {err['seen']} < {err['target']} "
            f"(step {err['epoch']}); {where}")

    def compile_ahead(self, arch: int = 90):
        """Compile the megakernel for CUDA compute capability `arch` without launching it (no GPU needed)."""
        return compile_ahead(self.kernel, self.args, self.launch_options, arch)

    def timings(self) -> torch.Tensor:
        """[tasks, 4] (wait start ns, start ns, end ns, SM) of the last step, when built with trace=True."""
        return self.trace.cpu()
