"""kernels/chunk_attention.py, a later prefill chunk's attention on a GPU, run on the CPU by Triton's interpreter
against the CPU path of runtime/prefill.py's cached_keys (the spec: blocks gathered, masked
scaled_dot_product_attention)."""
import json
import os
import subprocess
import sys

from conftest import REPO

SCRIPT = """
import json, types, torch
from distmk.kernels.chunk_attention import chunk_attention
from distmk.runtime.kv_cache import KVCache
from distmk.runtime.prefill import cached_keys
torch.manual_seed(0)
results = []
# (heads, kv heads, head dim, block size, blocks the chunk may see, first position, rows, window, parts)
for heads, kv_heads, d, bs, blocks, start, rows, window, parts in [
        (8, 2, 16, 4, 6, 10, 5, None, None), (8, 2, 32, 16, 4, 30, 16, None, 2), (4, 1, 16, 4, 8, 13, 7, 5, 4),
        (4, 4, 16, 8, 1, 0, 3, None, 1), (8, 2, 16, 4, 16, 40, 20, None, 8), (8, 2, 16, 4, 12, 37, 9, 6, 2),
        (14, 2, 16, 4, 6, 12, 11, None, 2)]:
    kv = KVCache(1, 3, blocks + 2, bs, kv_heads, d, torch.float32, "cpu")
    kv.k.normal_(), kv.v.normal_()
    pages = torch.randperm(kv.num_blocks)[:blocks]
    # the rows of a staged bucket: past the chunk's last, its last position again
    positions = torch.arange(start, start + rows).clamp(max=min(start + rows - 2, blocks * bs - 1))
    engine = types.SimpleNamespace(kv=kv, spec=types.SimpleNamespace(sliding_window=window),
                                   plan=types.SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads))
    q = torch.randn(rows, heads, d)
    spec = cached_keys(engine, pages, positions)(0, q.transpose(0, 1)[None], None, None)[0].transpose(0, 1)
    out = chunk_attention(q, kv.k[0], kv.v[0], pages, positions, blocks * bs, window, parts)
    results.append((out - spec).abs().max().item() / spec.abs().max().item())
print(json.dumps(results))
"""


def test_interpreted_chunk_attention_matches_the_cpu_path():
    """Keys read from permuted blocks in place, a kv head's query heads folded into rows (a fold that ends inside
    a row block; groups of 7 query heads, as qwen2.5-7b's), the keys split into 1 to 8 parts and weighed together,
    sliding windows, and the repeated last row of a staged bucket."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.splitlines()[-1])
    assert len(errors) == 7 and max(errors) < 1e-5, errors
