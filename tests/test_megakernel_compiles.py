"""The megakernel compiles for Hopper (sm_90) from this machine: Triton ships ptxas, so CI catches compile
errors and shared-memory overruns without a GPU. Shapes come from meta tensors, so 8B models cost nothing."""
import pytest
import torch

from distmk.graph import GraphConfig
from distmk.runtime.engine import Engine

HOPPER_SHARED_BYTES = 227 * 1024


@pytest.mark.parametrize("name, dtype, batch", [
    ("tiny-llama", torch.float32, 4), ("tiny-qwen3", torch.float32, 4), ("tiny-qwen2", torch.bfloat16, 8),
    ("tiny-mistral", torch.bfloat16, 1), ("llama-3-8b", torch.bfloat16, 1), ("qwen3-8b", torch.bfloat16, 8),
    ("qwen2.5-7b", torch.bfloat16, 64),
])
def test_megakernel_compiles_for_sm90(name, dtype, batch):
    engine = Engine(name, backend="triton", device="meta", dtype=dtype, max_context=1024,
                    config=GraphConfig(batch=batch, workers=132))
    compiled = engine.executor.compile_ahead(arch=90)
    assert compiled.metadata.shared <= HOPPER_SHARED_BYTES
    assert "megakernel" in compiled.asm["ptx"]


def test_tensor_parallel_megakernel_compiles_for_sm90():
    """tp=2: exchange pushes into peers' symmetric buffers and events signalled on every rank."""
    from distmk.reference.comm import run_simulated_ranks

    def compile_rank(rank, comm):
        engine = Engine("llama-3-8b", tp=2, rank=rank, comm=comm, backend="triton", device="meta",
                        dtype=torch.bfloat16, max_context=1024, config=GraphConfig(batch=4, workers=132))
        return engine.executor.compile_ahead(arch=90).metadata.shared

    assert all(shared <= HOPPER_SHARED_BYTES for shared in run_simulated_ranks(2, compile_rank))


def nvshmem_bitcode() -> str | None:
    """libnvshmem_device.bc from the nvidia-nvshmem wheel (a dev dependency), if installed."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("nvidia.nvshmem")
    for root in (spec.submodule_search_locations if spec else []):
        path = os.path.join(root, "lib", "libnvshmem_device.bc")
        if os.path.exists(path):
            return path
    return None


@pytest.mark.skipif(nvshmem_bitcode() is None, reason="needs the nvidia-nvshmem-cu13 wheel's device bitcode")
def test_nvshmem_transport_links_and_compiles_for_sm90():
    """The put-with-signal transport: Triton's calls into libnvshmem_device.bc link and assemble for sm_90
    (the signal op's value does not matter to the compiler; on a GPU it comes from nvshmem4py)."""
    from distmk.kernels.megakernel import compile_ahead
    from distmk.reference.comm import run_simulated_ranks

    def compile_rank(rank, comm):
        engine = Engine("llama-3-8b", tp=2, rank=rank, comm=comm, backend="triton", device="meta",
                        dtype=torch.bfloat16, max_context=1024, config=GraphConfig(batch=4, workers=132))
        ex = engine.executor
        options = {**ex.launch_options, "extern_libs": {"libnvshmem_device": nvshmem_bitcode()}}
        return compile_ahead(ex.kernel, {**ex.args, "TRANSPORT": 1, "SIGNAL_ADD": 10}, options, 90)

    for compiled in run_simulated_ranks(2, compile_rank):
        assert "nvshmemx_putmem_signal_block" in compiled.asm["ptx"] or "putmem_signal" in compiled.asm["llir"]
