"""The prefill benchmark (benchmarks/prefill.py): its FLOP count, its PyTorch baseline (the same KV cache as
distmk's prefill chunk), and the script itself on the CPU."""
import dataclasses
import json
import sys

import pytest
import torch

from conftest import run_cli
from distmk.graph import GraphConfig
from distmk.models.presets import preset
from distmk.models.shard import load_shard, plan_shard
from distmk.models.weights import RandomWeights
from distmk.runtime.engine import Engine
from distmk.runtime.prefill import prefill_chunk

from baselines import build_torch_prefill, prefill_chunk_flops


def test_prefill_chunk_flops_llama3_8b():
    spec = preset("llama-3-8b")
    qkv_params, rest_params = (4096 + 2 * 1024) * 4096, 4096 * 4096 + 3 * 14336 * 4096
    attention = 2 * 2 * 32 * 128 * (2048 * 2049 // 2)            # a layer's; causal: position p sees p + 1 keys
    flops = prefill_chunk_flops(spec, plan_shard(spec, 1, 0), 2048)
    # the last layer's products past its K and V feed nothing
    assert flops == 32 * 2 * qkv_params * 2048 + 31 * (2 * rest_params * 2048 + attention)
    assert flops == pytest.approx(28.8e12, rel=1e-2)              # 29 ms at an H200's 989 TFLOP/s
    # a later chunk sees the positions before it; tensor parallel ranks split the products
    later = prefill_chunk_flops(spec, plan_shard(spec, 1, 0), 512, start=1536)
    matmuls = 32 * 2 * qkv_params * 512 + 31 * 2 * rest_params * 512
    assert later - matmuls == 31 * 4 * 32 * 128 * sum(range(1537, 2049))
    assert prefill_chunk_flops(spec, plan_shard(spec, 2, 1), 2048) * 2 == flops


def test_prefill_chunk_flops_sliding_window():
    """A position sees at most the window's keys: past it, attention's FLOPs grow linearly."""
    window = 8
    spec = dataclasses.replace(preset("tiny-mistral"), sliding_window=window)
    plan, per_key = plan_shard(spec, 1, 0), (spec.num_layers - 1) * 4 * spec.num_heads * spec.head_dim
    matmuls_per_token = prefill_chunk_flops(spec, plan, 1) - per_key
    n = 3 * window
    keys = window * (window + 1) // 2 + (n - window) * window
    assert prefill_chunk_flops(spec, plan, n) == n * matmuls_per_token + per_key * keys


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen2"])    # plain, q/k-norm, qkv bias
def test_torch_prefill_writes_the_kv_cache_prefill_chunk_writes(name):
    """The baseline does the same work as distmk's prefill: every layer's K and V of the chunk agree."""
    n = 40
    engine = Engine(name, config=GraphConfig(batch=1, workers=1), max_context=48, max_seqs=1)
    tokens = torch.randint(0, engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    blocks = engine.kv.allocate([], n)
    baseline = build_torch_prefill(engine.spec, engine.weights, engine.max_context)
    with torch.inference_mode():
        prefill_chunk(engine, tokens.tolist(), 0, blocks)
        baseline.prefill(tokens)
    kv_heads, d = engine.plan.num_kv_heads, engine.spec.head_dim
    for layer in range(engine.spec.num_layers):
        for ours, theirs in ((engine.kv.k, baseline.k_cache), (engine.kv.v, baseline.v_cache)):
            paged = ours[layer][torch.tensor(blocks)].reshape(-1, kv_heads, d)[:n]
            torch.testing.assert_close(paged, theirs[layer][0, :, :n].transpose(0, 1), rtol=1e-4, atol=1e-5)


def test_torch_prefill_refuses_a_sliding_window_it_lacks():
    spec = dataclasses.replace(preset("tiny-mistral"), sliding_window=8)
    weights = load_shard(spec, RandomWeights(spec), plan_shard(spec, 1, 0), torch.float32, "cpu")
    with pytest.raises(ValueError, match="no sliding window"):
        build_torch_prefill(spec, weights, max_context=64)


def test_prefill_chunk_flops_mixture_of_experts():
    """A sparse layer's MLP FLOPs are its router's and each row's top-k experts' (qwen3-30b-a3b: 8 of 128);
    tiny-qwen3-moe's dense layer 1 keeps its dense MLP."""
    spec = preset("qwen3-30b-a3b")
    h, n = spec.hidden_size, 512
    qkv_params = (32 + 2 * 4) * 128 * h
    rest_params = h * 32 * 128 + 128 * h + 8 * 3 * 768 * h
    attention = 2 * 2 * 32 * 128 * (n * (n + 1) // 2)
    assert prefill_chunk_flops(spec, plan_shard(spec, 1, 0), n) == (
        48 * 2 * qkv_params * n + 47 * (2 * rest_params * n + attention))
    spec = preset("tiny-qwen3-moe")                   # layers 0 and 2 sparse, 1 dense; the last one's rest unused
    plan = plan_shard(spec, 1, 0)
    h = spec.hidden_size
    dense = dataclasses.replace(spec, moe_layers=())
    sparse_mlp, dense_mlp = spec.num_experts * h + spec.experts_per_token * 3 * 256 * h, 3 * spec.intermediate_size * h
    assert prefill_chunk_flops(spec, plan, 10) - prefill_chunk_flops(dense, plan_shard(dense, 1, 0), 10) == (
        2 * (sparse_mlp - dense_mlp) * 10)


def test_torch_prefill_refuses_mixture_of_experts_and_the_benchmark_goes_on(tmp_path):
    spec = preset("tiny-mixtral")
    weights = load_shard(spec, RandomWeights(spec), plan_shard(spec, 1, 0), torch.float32, "cpu")
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        build_torch_prefill(spec, weights, max_context=64)
    out = tmp_path / "prefill.json"
    proc = run_cli(sys.executable, "benchmarks/prefill.py", "--model", "tiny-mixtral", "--device", "cpu",
                   "--chunks", "16", "--baseline", "eager", "--iters", "1", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert "no mixture-of-experts layers" in result["torch_baseline_error"]
    chunk, = result["chunks"]
    assert chunk["distmk_ms"] > 0 and chunk["torch_ms"] is None
    assert chunk["flops"] == prefill_chunk_flops(spec, plan_shard(spec, 1, 0), 16)


def test_prefill_benchmark_on_cpu(tmp_path):
    out = tmp_path / "prefill.json"
    proc = run_cli(sys.executable, "benchmarks/prefill.py", "--model", "tiny-llama", "--device", "cpu",
                   "--chunks", "16,48", "--baseline", "eager", "--iters", "2", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result == json.loads(proc.stdout)
    assert result["model"] == "tiny-llama" and result["dtype"] == "float32" and result["torch_baseline"] == "eager"
    assert result["bf16_dense_flops_per_s"] is None and result["distmk_commit"]
    spec = preset("tiny-llama")
    assert [c["tokens"] for c in result["chunks"]] == [16, 48]
    for chunk in result["chunks"]:
        assert chunk["flops"] == prefill_chunk_flops(spec, plan_shard(spec, 1, 0), chunk["tokens"])
        assert chunk["distmk_ms"] > 0 and chunk["torch_ms"] > 0
        assert chunk["speedup_vs_torch"] == pytest.approx(chunk["torch_ms"] / chunk["distmk_ms"])
        assert chunk["roofline_ms"] is None and chunk["roofline_fraction"] is None      # no peak off a GPU


def test_prefill_benchmark_names_a_chunk_too_long(capsys):
    import prefill          # its main in this process: the process itself runs in test_prefill_benchmark_on_cpu
    assert prefill.main(["--model", "tiny-llama", "--device", "cpu", "--chunks", "16,2000", "--baseline", "none",
                         "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "--chunks up to 2000 tokens" in err and "1024" in err


def test_prefill_benchmark_times_a_later_chunk(tmp_path, capsys):
    """--start 20: the chunk at positions 20..35, after an untimed one of 0..19; its FLOPs see the keys before it.
    The PyTorch baseline prefills first chunks alone, so it is refused."""
    out = tmp_path / "prefill.json"
    proc = run_cli(sys.executable, "benchmarks/prefill.py", "--model", "tiny-llama", "--device", "cpu",
                   "--chunks", "16", "--start", "20", "--baseline", "none", "--iters", "1", "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    chunk, = json.loads(out.read_text())["chunks"]
    spec = preset("tiny-llama")
    assert chunk["start"] == 20 and chunk["distmk_ms"] > 0
    assert chunk["flops"] == prefill_chunk_flops(spec, plan_shard(spec, 1, 0), 16, start=20)
    import prefill
    with pytest.raises(SystemExit) as exit_:
        prefill.parse_args(["--model", "tiny-llama", "--device", "cpu", "--chunks", "16", "--start", "20"])
    assert exit_.value.code == 2 and "--baseline none" in capsys.readouterr().err


def test_prefill_benchmark_times_the_fp8_twin_as_the_megakernel_holds_it(tmp_path):
    """--quantize fp8: the engine holds the e4m3 products alone (its chunks multiply them as --prefill-fp8 says,
    as test_fp8.py's prefill tests check) and the baseline multiplies their dequantized weights; both are timed."""
    import prefill
    out = tmp_path / "prefill.json"
    assert prefill.main(["--model", "tiny-qwen3", "--device", "cpu", "--quantize", "fp8", "--chunks", "16",
                         "--prefill-fp8", "w8a8", "--baseline", "eager", "--iters", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["quantize"] == "fp8" and result["e4m3_products"] == ["w_down", "w_gate", "w_up", "wo", "wqkv"]
    assert result["prefill_fp8"] == "w8a8"
    chunk, = result["chunks"]
    assert chunk["distmk_ms"] > 0 and chunk["torch_ms"] > 0
