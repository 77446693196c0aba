"""KernelOptions: how the megakernel is built and run (GraphConfig says what it runs). One declaration, read by
the executor, recorded in benchmark JSON, varied by autotuning."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from distmk.errors import DistmkError


@dataclass(frozen=True)
class KernelOptions:
    timeout_s: float = 5.0          # the longest a task may wait for its event before the step is abandoned
    num_warps: int = 4              # tl kernel: warps of a worker (the ring's task partition is one warpgroup)
    num_stages: int = 4             # tl kernel: software-pipeline depth of the matmul loads
    block_n: int = 32               # tl kernel: rows of an o_proj / down load step
    block_k: int | None = None      # tl kernel: columns of a load step (None: 256 in bf16, 128 in float32)
    mlp_block_n: int = 64           # tl kernel: rows of a gate_up load step
    lm_block_n: int = 128           # tl kernel: rows of an lm_head load step
    prefetch_kb: int = 256          # tl kernel: L2 prefetch of a task's weights before its wait (0: none)
    trace: bool = False             # record every task's wait, start, end and SM (kernels/trace.py)
    cuda_graph: bool = True         # replay the launch as a CUDA graph
    transport: str = "auto"         # tp > 1: auto, pointer (peer stores) or nvshmem (put with signal)
    kernel: str = "auto"            # auto, ring (Gluon weight ring, Hopper) or tl
    ring_block_k: int = 0           # ring: columns of a slot (0: the widest of 256/128/64 dividing every K)
    ring_slots: int = 0             # ring: weight slots (0: as many as its shared memory holds)
    ring_inputs: int = 4            # ring: input slices in flight

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise DistmkError(f"kernel option timeout_s must be > 0, got {self.timeout_s}")
        for name in ("num_warps", "block_n", "mlp_block_n", "lm_block_n") + (("block_k",) if self.block_k else ()):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise DistmkError(f"kernel option {name} must be a power of two, got {value}")
        for name in ("num_stages", "ring_inputs"):
            if getattr(self, name) < 1:
                raise DistmkError(f"kernel option {name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefetch_kb", "ring_block_k", "ring_slots"):
            if getattr(self, name) < 0:
                raise DistmkError(f"kernel option {name} must be >= 0, got {getattr(self, name)}")

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
