"""KernelOptions: how the megakernel is built and run (GraphConfig says what it runs). One declaration, read by
the executor, recorded in benchmark JSON, varied by autotuning, and the triton backend's command-line flags."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from distmk.errors import DistmkError

MAX_TIMEOUT_S = (2 ** 31 - 1) // 10 ** 6       # kernels take the timeout as a 32-bit count of microseconds


def option(default, help: str, flag: str | None = None, choices: tuple | None = None):
    """A KernelOptions field that is also a command-line flag (distmk.cli.add_kernel_args): `--flag` or
    `--<name>`, with this help and choices."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices})


@dataclass(frozen=True)
class KernelOptions:
    timeout_s: float = option(5.0, "seconds a task may wait for its event before the step is abandoned",
                              flag="timeout")
    num_warps: int = option(4, "tl kernel: warps of a worker (the ring's task partition is one warpgroup)")
    num_stages: int = option(4, "tl kernel: software-pipeline depth of the matmul loads")
    block_n: int = option(0, "tl kernel: rows of an o_proj / down load step (0: an o_proj tile's height, at most "
                             "32)")
    block_k: int | None = option(None, "tl kernel: columns of a load step (default: 256 in bf16, 128 in float32)")
    mlp_block_n: int = option(64, "tl kernel: rows of a gate_up load step")
    expert_block_n: int = option(64, "tl kernel: rows of an expert down load step")
    lm_block_n: int = option(128, "tl kernel: rows of an lm_head load step")
    prefetch_kb: int = option(256, "tl kernel: KB of L2 prefetch of a task's weights before its wait (0: none)")
    prefetch_tasks: str = option("", "tl kernel: the task types that prefetch, comma-separated (empty: every type "
                                     "with a prefetch)")
    trace: bool = False             # record every task's wait, start, end and SM (kernels/trace.py)
    cuda_graph: bool = True         # replay the launch as a CUDA graph
    transport: str = option("auto", "tp > 1: how exchange tiles reach peers (auto: peer pointers where every peer "
                                    "is reachable by one, else NVSHMEM put-with-signal)",
                            choices=("auto", "pointer", "nvshmem"))
    kernel: str = option("auto", "the megakernel: the Gluon weight ring (Hopper, bf16, exchanges through "
                                 "peer pointers), the tl one, or the ring where it runs",
                         choices=("auto", "ring", "tl"))
    ring_block_k: int = option(0, "ring: columns of an input slice and of a bf16 slot (0: the widest of 256/128/64 "
                                  "dividing every K; e4m3 slots hold 256 columns)")
    stream_e4m3: int = option(0, "1 = the products a model holds in e4m3 (--quantize fp8, FP8 checkpoints) stream so: "
                                 "both kernels dequantize them as they load them (device/ring.py mma_block_fp8; an "
                                 "8B model's decode step 0.78-0.83 of bf16's on an H100); 0 = their dequantized bf16 "
                                 "copies stream")
    ring_slots: int = option(0, "ring: weight slots (0: as many as its shared memory holds)")
    ring_inputs: int = option(0, "ring: input slices in flight (0: 4, or 6 where e4m3 weights stream and every "
                                 "product's K holds 5 slices or more)")
    ring_attention_keys: int = option(0, "ring: consecutive keys a thread of an attention task holds a pass, a "
                                          "power of two (0: 2 in a MoE model or one streaming e4m3 weights, else 4, "
                                          "fewer for more heads; fewer is less code, more passes)")
    ring_inflight: int = option(2, "ring: weight slots a worker has in flight at most while its ring fills ahead "
                                   "of a task, so that the task's event poll and first inputs queue behind fewer "
                                   "bytes (0: every free slot)")

    def __post_init__(self):
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:
            raise DistmkError(f"kernel option timeout_s must be > 0 and at most {MAX_TIMEOUT_S} s (the kernel's "
                              f"32-bit count of microseconds), got {self.timeout_s}")
        sized = tuple(n for n in ("block_n", "block_k") if getattr(self, n))
        for name in ("num_warps", "mlp_block_n", "expert_block_n", "lm_block_n") + sized:
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise DistmkError(f"kernel option {name} must be a power of two, got {value}")
        if self.num_stages < 1:
            raise DistmkError(f"kernel option num_stages must be >= 1, got {self.num_stages}")
        if self.ring_attention_keys & (self.ring_attention_keys - 1) or self.ring_attention_keys < 0:
            raise DistmkError(f"kernel option ring_attention_keys must be 0 or a power of two, got "
                              f"{self.ring_attention_keys}")
        for name in ("prefetch_kb", "ring_block_k", "ring_slots", "ring_inputs", "ring_inflight", "block_n"):
            if getattr(self, name) < 0:
                raise DistmkError(f"kernel option {name} must be >= 0, got {getattr(self, name)}")
        if self.stream_e4m3 not in (0, 1):
            raise DistmkError(f"kernel option stream_e4m3 must be 0 or 1, got {self.stream_e4m3}")

    @classmethod
    def of(cls, options: dict) -> "KernelOptions":
        """From a dict of options (Engine's kernel_options, an autotuning candidate), naming any unknown one."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise DistmkError(f"unknown kernel options {unknown}; known: {sorted(known)}")
        return cls(**options)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
