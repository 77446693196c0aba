"""The decode benchmark's baselines (benchmarks/baselines.py): the per-op PyTorch decoder gives
transformers' greedy tokens (one rank and tensor parallel over gloo; mixture-of-experts layers by either of its
ways to run the experts), its router chooses distmk's experts from distmk's KV cache, and the roofline byte
count (the chosen experts only, in a sparse layer)."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import PROMPT, SMALL, TINY, TINY_MOE, hf_greedy
from distmk.models.presets import preset
from distmk.models.shard import load_shard, plan_shard
from distmk.models.weights import RandomWeights
from distmk.runtime.engine import Engine

from baselines import (build_torch_decoder, decode_step_bytes, distinct_experts, hf_eager_ms_per_token,
                       paged_state, routed_experts)

NEW_TOKENS = 16


def greedy_rows(name, prompts, lags, tp=1, rank=0, sparse="auto"):
    """Greedy continuations of `prompts`, one row each, through the decoder's step; row r enters `lags[r]`
    steps late, so rows sit at different positions within one step."""
    spec = preset(name)
    weights = load_shard(spec, RandomWeights(spec), plan_shard(spec, tp, rank), torch.float32, "cpu")
    step = build_torch_decoder(spec, weights, "cpu", torch.float32, max_batch=len(prompts), max_context=64,
                               sparse=sparse).step
    seqs = [list(p) for p in prompts]
    steps = [len(p) + NEW_TOKENS - 1 for p in prompts]      # one per input token, the last generated one aside
    for t in range(max(lag + n for lag, n in zip(lags, steps))):
        local = [t - lag for lag in lags]
        active = [0 <= i < n for i, n in zip(local, steps)]
        tokens = [s[i] if a else 0 for s, i, a in zip(seqs, local, active)]   # idle rows write position 0
        positions = [i if a else 0 for i, a in zip(local, active)]
        with torch.inference_mode():
            next_tokens = step(torch.tensor(tokens), torch.tensor(positions)).tolist()
        for s, i, a, token in zip(seqs, local, active, next_tokens):
            if a and i + 1 == len(s):
                s.append(token)
    return [s[len(p):] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("name", TINY + TINY_MOE)
def test_torch_decoder_matches_transformers(name):
    short = PROMPT[3:]
    tokens = greedy_rows(name, [PROMPT, short], lags=[0, 5])
    assert tokens[0] == hf_greedy(name)[0][:NEW_TOKENS]
    assert tokens[1] == hf_greedy(name, tuple(short), NEW_TOKENS)[0]


@pytest.mark.parametrize("sparse", ["gather", "all"])
@pytest.mark.parametrize("name", TINY_MOE)
def test_torch_decoder_runs_the_experts_either_way(name, sparse):
    """The chosen experts' weights gathered and run by batched products, or every expert over every row: one
    row (auto: the gather) and three rows (auto: every expert), both give transformers' tokens."""
    short = PROMPT[3:]
    assert greedy_rows(name, [PROMPT], lags=[0], sparse=sparse)[0] == hf_greedy(name)[0][:NEW_TOKENS]
    tokens = greedy_rows(name, [PROMPT, short, PROMPT], lags=[0, 5, 2], sparse=sparse)
    assert tokens[0] == tokens[2] == hf_greedy(name)[0][:NEW_TOKENS]
    assert tokens[1] == hf_greedy(name, tuple(short), NEW_TOKENS)[0]


@pytest.mark.parametrize("name, sparse", [("tiny-qwen3", "auto"), ("tiny-qwen3-moe", "gather"),
                                          ("tiny-qwen3-moe", "all")])
def test_fp8_decoder_multiplies_the_e4m3_products_as_the_weights_they_dequantize_to(name, sparse):
    """The compiled FP8 baselines' decoder reads the e4m3 products and their block scales (a MoE model's experts too,
    by either way to run them): weight-only (w8a16), it steps as the decoder on their dequantized weights does;
    w8a8, the products' inputs quantized a row and 128 columns as distmk's W8A8 prefill does, it moves the K and V
    it writes by activation quantization's error alone. Without e4m3 products, or with an unknown recipe, it refuses."""
    from distmk.models.fp8 import QuantizedAtLoad
    spec = preset(name)
    weights = load_shard(spec, QuantizedAtLoad(RandomWeights(spec), spec), plan_shard(spec, 1, 0), keep_fp8=True)
    assert {"wo", "w_gate", "w_up", "w_down"} <= set(weights.fp8) if name == "tiny-qwen3" else \
        {"wo", "expert_gate", "expert_up", "expert_down"} <= set(weights.fp8)
    tokens, positions = torch.tensor([5, 9]), torch.tensor([0, 0])

    def step(fp8):
        """The step's next tokens and the K and V it wrote."""
        decoder = build_torch_decoder(spec, weights, "cpu", torch.float32, max_batch=2, max_context=16, sparse=sparse,
                                      fp8=fp8)
        with torch.inference_mode():
            return decoder.step(tokens, positions), torch.stack(decoder.k_cache + decoder.v_cache)

    (dequantized, kv), (w8a16, kv_w8a16), (_, kv_w8a8) = (step(fp8) for fp8 in (None, "w8a16", "w8a8"))
    assert torch.equal(dequantized, w8a16) and torch.equal(kv, kv_w8a16)
    assert 0 < ((kv_w8a8 - kv).norm() / kv.norm()).item() < 2 ** -3
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp8': one of w8a16, w8a8"):
        build_torch_decoder(spec, weights, "cpu", torch.float32, max_batch=2, max_context=16, fp8="fp8")
    weights.fp8.clear()
    with pytest.raises(ValueError, match="needs weights with e4m3 products"):
        build_torch_decoder(spec, weights, "cpu", torch.float32, max_batch=2, max_context=16, fp8="w8a16")


def test_torch_decoder_refuses_an_unknown_sparse_path():
    with pytest.raises(ValueError, match="unknown sparse MLP path 'each'"):
        greedy_rows("tiny-mixtral", [PROMPT], lags=[0], sparse="each")


@pytest.mark.parametrize("name", TINY_MOE)
def test_router_chooses_distmk_experts_from_its_kv_cache(name):
    """decode.py's routing: the decoder's router, run from distmk's paged KV cache, tokens and positions, chooses
    the experts distmk's own step chose (its workspace holds the last sparse layer's), and the experts a layer
    reads are the distinct ones of the batch's choices."""
    engine = Engine(name, config=SMALL, max_context=64)
    engine.kv.k.normal_(generator=torch.Generator().manual_seed(1))
    engine.kv.v.normal_(generator=torch.Generator().manual_seed(2))
    blocks = [engine.kv.allocate([], 40) for _ in range(4)]
    tokens, positions = [3, 50, 100, 7], [39, 20, 5, 33]
    buf = engine.step(tokens, positions, blocks)
    ours = buf["route_expert"][:4].clone()
    chosen = routed_experts(engine.spec, engine.weights, 4, 64, "cpu", torch.float32,
                            paged_state(engine.kv.k, engine.kv.v, blocks, tokens, positions))
    spec = engine.spec
    assert chosen.shape == (len(spec.moe_layers), 4, spec.experts_per_token)
    assert torch.equal(chosen[-1], ours)
    assert distinct_experts(chosen) == [len(set(layer.flatten().tolist())) for layer in chosen]
    assert all(spec.experts_per_token <= n <= spec.num_experts for n in distinct_experts(chosen))
    assert distinct_experts(torch.tensor([[[0, 1], [1, 0], [2, 1]], [[3, 3], [3, 3], [3, 3]]])) == [3, 1]


def _tp_rank_main(rank, world, init_file, name, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokens = greedy_rows(name, [PROMPT], lags=[0], tp=world, rank=rank)[0]
        torch.save(tokens, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,tp", [("tiny-qwen2", 2), ("tiny-llama", 4),  # KV heads split; replicated
                                     ("tiny-mixtral", 2)])                     # experts split
def test_tensor_parallel_decoder_matches_transformers(name, tp, tmp_path):
    mp.spawn(_tp_rank_main, args=(tp, str(tmp_path / "rendezvous"), name, str(tmp_path / "tokens")), nprocs=tp)
    for rank in range(tp):
        assert torch.load(tmp_path / f"tokens.{rank}") == hf_greedy(name)[0][:NEW_TOKENS]


def test_hf_eager_baseline_runs_on_cpu():
    spec = preset("tiny-qwen3")
    ms = hf_eager_ms_per_token(spec, RandomWeights(spec), batch=2, context=8, new_tokens=8, dtype=torch.float32,
                               device="cpu")
    assert ms > 0


def test_decode_step_bytes_llama3_8b():
    spec = preset("llama-3-8b")
    h, v = spec.hidden_size, spec.vocab_size
    weights = decode_step_bytes(spec, plan_shard(spec, 1, 0), batch=1, context=0)
    # Every parameter once, in bf16, except the embedding table: one row of it.
    assert weights == 2 * (spec.num_parameters() - v * h + h)
    assert 2 * spec.num_parameters() == pytest.approx(16.06e9, rel=1e-3)
    assert weights == pytest.approx(15.01e9, rel=1e-3)
    kv = decode_step_bytes(spec, plan_shard(spec, 1, 0), batch=4, context=1000) - weights - 2 * 3 * h
    assert kv == 2 * 32 * 8 * 128 * 1000 * 4 * 2


def test_decode_step_bytes_tensor_parallel():
    """Column/row-parallel shards add up to the whole, norms and embedding rows are read on every rank, and
    with fewer KV heads than ranks each rank reads the one KV head its query heads share."""
    spec = preset("qwen2.5-7b")                       # q/k/v bias
    h, layers = spec.hidden_size, spec.num_layers
    one = decode_step_bytes(spec, plan_shard(spec, 1, 0), batch=1, context=0)
    replicated = 2 * ((2 * layers + 1) * h + h)      # layer norms, final norm, one embedding row
    for tp in (2, 4):
        ranks = [decode_step_bytes(spec, plan_shard(spec, tp, r), batch=1, context=0) for r in range(tp)]
        assert sum(ranks) - (tp - 1) * replicated == one
    spec = preset("qwen3-0.6b")                       # 8 KV heads over 16 ranks
    plan = plan_shard(spec, 16, 3)
    kv = decode_step_bytes(spec, plan, batch=1, context=100) - decode_step_bytes(spec, plan, batch=1, context=0)
    assert kv == 2 * spec.num_layers * 1 * spec.head_dim * 100 * 2


def test_decode_step_bytes_counts_the_chosen_experts_only():
    """A sparse layer reads its router and the experts the step chose: qwen3-30b-a3b at batch 1 reads every
    parameter once but the embedding table (one row) and the 120 experts of each layer that it did not choose,
    its 3.3 billion active parameters."""
    spec = preset("qwen3-30b-a3b")
    plan, h, v = plan_shard(spec, 1, 0), spec.hidden_size, spec.vocab_size
    expert = 3 * spec.moe_intermediate_size * h
    one = decode_step_bytes(spec, plan, batch=1, context=0, experts_read=[8] * 48)
    assert one == 2 * (spec.num_parameters() - v * h + h - 48 * 120 * expert)
    assert (one / 2 + v * h) / 1e9 == pytest.approx(3.35, abs=0.01)
    assert decode_step_bytes(spec, plan, batch=1, context=0) == one               # at most top_k of them
    # eight rows: each layer reads the union of their choices; the default is the most they can choose
    read = [40 + i % 20 for i in range(48)]
    eight = decode_step_bytes(spec, plan, batch=8, context=0, experts_read=read)
    assert eight - one == 2 * (7 * h + expert * (sum(read) - 8 * 48))
    assert decode_step_bytes(spec, plan, batch=8, context=0) == decode_step_bytes(spec, plan, 8, 0, 2, [64] * 48)
    assert decode_step_bytes(spec, plan, batch=32, context=0) == decode_step_bytes(spec, plan, 32, 0, 2, [128] * 48)
    # mixtral-8x7b under tp=2: each rank reads its half of every chosen expert, and the whole router
    spec = preset("mixtral-8x7b")
    h = spec.hidden_size
    ranks = [decode_step_bytes(spec, plan_shard(spec, 2, r), 1, 0, 2, [2] * 32) for r in range(2)]
    whole = decode_step_bytes(spec, plan_shard(spec, 1, 0), 1, 0, 2, [2] * 32)
    assert ranks[0] == ranks[1] and 2 * ranks[0] - whole == 2 * ((2 * 32 + 1) * h + h + 32 * 8 * h)
    assert whole - decode_step_bytes(spec, plan_shard(spec, 1, 0), 1, 0, 2, [1] * 32) == 2 * 32 * 3 * 14336 * h


@pytest.mark.parametrize("experts_read, message", [([8] * 47, "for each of the 48 sparse layers"),
                                                   ([129] * 48, "0..128 experts")])
def test_decode_step_bytes_refuses_a_wrong_expert_count(experts_read, message):
    spec = preset("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=message):
        decode_step_bytes(spec, plan_shard(spec, 1, 0), 1, 0, experts_read=experts_read)


@pytest.mark.parametrize("name, batch", [("tiny-mixtral", 1), ("tiny-qwen3-moe", 4)])
def test_decode_benchmark_counts_the_experts_its_step_chose(name, batch, tmp_path):
    """decode.py on the CPU (reference backend): the experts read per sparse layer come from the step it timed
    (its route_history, with which the decoder's router agrees on every layer and row), and the step's bytes
    count them."""
    import json
    import sys
    from conftest import run_cli
    out = tmp_path / "decode.json"
    proc = run_cli(sys.executable, "benchmarks/decode.py", "--model", name, "--backend", "reference", "--device",
                   "cpu", "--batch", str(batch), "--context", "32", "--iters", "2", "--skip-hf", "--compile-baseline",
                   "--json", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    spec = preset(name)
    read = result["experts_read_per_layer"]
    assert len(read) == len(spec.moe_layers)
    assert all(spec.experts_per_token <= n <= min(spec.num_experts, batch * spec.experts_per_token) for n in read)
    assert result["route_agreement"] == 1.0 and result["experts_read_source"] == "distmk's step"
    assert result["baseline_weights"] == "distmk's"
    assert result["step_bytes"] == decode_step_bytes(spec, plan_shard(spec, 1, 0), batch, 32, 4, read)
    assert result["step_ms"] > 0 and result["cudagraph_ms"] is None and result["baseline_errors"] is None


@pytest.mark.parametrize("name, e4m3", [("llama-3-8b", ("wqkv", "wo", "w_gate", "w_up", "w_down")),
                                        ("qwen3-30b-a3b", ("wqkv", "wo", "expert_gate", "expert_up", "expert_down"))])
def test_decode_step_bytes_of_e4m3_products(name, e4m3):
    """A product streamed in e4m3 is read as a byte a weight and a float32 scale a 128 x 128 block, in place of
    two bytes: the step reads that much less (a sparse layer: of the experts it chose)."""
    spec = preset(name)
    plan = plan_shard(spec, 1, 0)
    h, d = spec.hidden_size, spec.head_dim
    attention = ((plan.num_heads + 2 * plan.num_kv_heads) * d + plan.num_heads * d) * h * spec.num_layers
    mlp = (3 * plan.inter * h * len(spec.dense_layers)
           + 3 * plan.expert_inter * h * spec.experts_per_token * len(spec.moe_layers))
    read = [spec.experts_per_token] * len(spec.moe_layers)
    saved = (decode_step_bytes(spec, plan, 1, 512, experts_read=read)
             - decode_step_bytes(spec, plan, 1, 512, experts_read=read, e4m3=e4m3))
    assert saved == pytest.approx((attention + mlp) * (1 - 4 / 128 ** 2), abs=2)
