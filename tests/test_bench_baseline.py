"""The decode benchmark's baselines (benchmarks/baselines.py): the per-op PyTorch decoder gives
transformers' greedy tokens (one rank and tensor parallel over gloo), and the roofline byte count."""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import PROMPT, TINY, hf_greedy
from distmk.models.presets import preset
from distmk.models.shard import load_shard, plan_shard
from distmk.models.weights import RandomWeights

from baselines import build_torch_decoder, decode_step_bytes, hf_eager_ms_per_token

NEW_TOKENS = 16


def greedy_rows(name, prompts, lags, tp=1, rank=0):
    """Greedy continuations of `prompts`, one row each, through the decoder's step; row r enters `lags[r]`
    steps late, so rows sit at different positions within one step."""
    spec = preset(name)
    weights = load_shard(spec, RandomWeights(spec), plan_shard(spec, tp, rank), torch.float32, "cpu")
    step = build_torch_decoder(spec, weights, "cpu", torch.float32, max_batch=len(prompts), max_context=64).step
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


@pytest.mark.parametrize("name", TINY)
def test_torch_decoder_matches_transformers(name):
    short = PROMPT[3:]
    tokens = greedy_rows(name, [PROMPT, short], lags=[0, 5])
    assert tokens[0] == hf_greedy(name)[0][:NEW_TOKENS]
    assert tokens[1] == hf_greedy(name, tuple(short), NEW_TOKENS)[0]


def _tp_rank_main(rank, world, init_file, name, out_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokens = greedy_rows(name, [PROMPT], lags=[0], tp=world, rank=rank)[0]
        torch.save(tokens, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,tp", [("tiny-qwen2", 2), ("tiny-llama", 4)])  # KV heads split; replicated
def test_tensor_parallel_decoder_matches_transformers(name, tp, tmp_path):
    mp.spawn(_tp_rank_main, args=(tp, str(tmp_path / "rendezvous"), name, str(tmp_path / "tokens")), nprocs=tp)
    for rank in range(tp):
        assert torch.load(tmp_path / f"tokens.{rank}") == hf_greedy(name)[0][:NEW_TOKENS]


def test_hf_eager_baseline_runs_on_cpu():
    spec = preset("tiny-qwen3")
    ms = hf_eager_ms_per_token(spec, RandomWeights(spec), batch=2, context=8, new_tokens=4, dtype=torch.float32,
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
