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
