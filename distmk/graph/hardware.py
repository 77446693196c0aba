"""What a task graph takes from the GPU it is built for: the worker count (the megakernel runs one
persistent program per SM) and the HBM bandwidth the scheduler's cost model divides among the workers;
also the tensor-core peak that the prefill benchmark's roofline divides by. Off a GPU the first two are an
H200's, so that a graph built on the CPU (CI, `python -m distmk.graph`) is the same on every machine.
Looked up, not measured at start: every tensor-parallel rank must build the same table.
"""
from __future__ import annotations

import torch

DEFAULT_WORKERS = 132                 # an H100 / H200 SXM's SM count

# Streaming-read bandwidth in bytes/s by a part of the GPU's name; the first key found in the name counts,
# so "H100 PCIe" stands before "H100". Vendor peak figures, except where measured.
HBM_BYTES_PER_S = {
    "H200": 4.5e12,                   # measured streaming read (benchmarks/baselines.py), rounded down
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H100": 3.35e12,                  # SXM
    "A100-SXM4-80GB": 2.04e12,
    "A100 80GB PCIe": 1.94e12,
    "A100": 1.56e12,                  # 40 GB
    "B200": 8.0e12,
}
DEFAULT_HBM_BYTES_PER_S = HBM_BYTES_PER_S["H200"]

# Dense (no sparsity) bf16 tensor-core FLOP/s by a part of the GPU's name, looked up as HBM_BYTES_PER_S is.
# Vendor peak figures: the ceiling of a prefill chunk, whose time is its matrix products.
BF16_DENSE_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,                   # SXM
    "A100": 312e12,
    "B200": 2250e12,
}


def sm_workers(device) -> int:
    """One worker per SM of a CUDA device; DEFAULT_WORKERS for any other device."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_WORKERS
    return torch.cuda.get_device_properties(device).multi_processor_count


def hbm_bytes_per_s(device) -> float:
    """The table's figure for a CUDA device's name; DEFAULT_HBM_BYTES_PER_S off a GPU or for a GPU it lacks."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_HBM_BYTES_PER_S
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), DEFAULT_HBM_BYTES_PER_S)


def bf16_dense_flops(device) -> float | None:
    """The table's bf16 tensor-core peak for a CUDA device's name; None off a GPU or for a GPU it lacks
    (a roofline is then not stated rather than guessed)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in BF16_DENSE_FLOPS.items() if key in name), None)
