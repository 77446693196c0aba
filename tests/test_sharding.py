"""Tensor-parallel sharding: shards gather back to the original weights; ranks read only their slices."""
import pytest
import torch

from distmk.errors import ShardingError
from distmk.models.presets import PRESETS, preset
from distmk.models.shard import load_shard, plan_shard
from distmk.models.spec import spec_from_hf_config
from distmk.models.weights import CheckpointWeights, RandomWeights
from conftest import TINY


def split_qkv(t, plan, d):
    """A fused local q|k|v tensor → (q rows, {global kv head: k rows}, {global kv head: v rows})."""
    hq, hkv = plan.num_heads * d, plan.num_kv_heads * d
    k = {plan.kv_head0 + j: t[hq + j * d:hq + (j + 1) * d] for j in range(plan.num_kv_heads)}
    v = {plan.kv_head0 + j: t[hq + hkv + j * d:hq + hkv + (j + 1) * d] for j in range(plan.num_kv_heads)}
    return t[:hq], k, v


def merge_heads(parts, num_kv_heads):
    """Concatenate KV heads from every rank; replicated copies must agree."""
    heads = {}
    for part in parts:
        for h, rows in part.items():
            if h in heads:
                assert torch.equal(heads[h], rows)
            heads[h] = rows
    return torch.cat([heads[h] for h in range(num_kv_heads)])


def gather(spec, shards):
    """Rebuild the Hugging Face state dict from every rank's shard."""
    d, first = spec.head_dim, shards[0]
    out = {"model.embed_tokens.weight": first.embed, "model.norm.weight": first.final_norm}
    head = torch.cat([s.lm_head[:s.plan.vocab_valid] for s in shards])
    out["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"] = head
    for i in range(spec.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        fused = [("weight", [s.layers[i].wqkv for s in shards])]
        if spec.qkv_bias:
            fused.append(("bias", [s.layers[i].bqkv for s in shards]))
        for kind, tensors in fused:
            q, k, v = zip(*(split_qkv(t, s.plan, d) for t, s in zip(tensors, shards)))
            out[a + "q_proj." + kind] = torch.cat(q)
            out[a + "k_proj." + kind] = merge_heads(k, spec.num_kv_heads)
            out[a + "v_proj." + kind] = merge_heads(v, spec.num_kv_heads)
        out[a + "o_proj.weight"] = torch.cat([s.layers[i].wo for s in shards], dim=1)
        out[p + "mlp.gate_proj.weight"] = torch.cat([s.layers[i].w_gate for s in shards])
        out[p + "mlp.up_proj.weight"] = torch.cat([s.layers[i].w_up for s in shards])
        out[p + "mlp.down_proj.weight"] = torch.cat([s.layers[i].w_down for s in shards], dim=1)
        out[p + "input_layernorm.weight"] = first.layers[i].input_norm
        out[p + "post_attention_layernorm.weight"] = first.layers[i].post_norm
        if spec.qk_norm:
            out[a + "q_norm.weight"], out[a + "k_norm.weight"] = first.layers[i].q_norm, first.layers[i].k_norm
    return out


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", TINY)
def test_gathered_shards_equal_original(name, tp):
    spec = preset(name)
    if spec.num_heads % tp or (spec.num_kv_heads < tp and tp % spec.num_kv_heads):
        pytest.skip(f"{name} does not split over tp={tp}")
    src = RandomWeights(spec)
    shards = [load_shard(spec, src, plan_shard(spec, tp, r)) for r in range(tp)]
    original, rebuilt = src.state_dict(), gather(spec, shards)
    assert rebuilt.keys() == original.keys()
    for k in original:
        assert torch.equal(rebuilt[k], original[k]), k
    # vocab padding rows are zero and the same count on every rank
    assert len({s.lm_head.shape[0] for s in shards}) == 1
    for s in shards:
        assert not s.lm_head[s.plan.vocab_valid:].any()


def test_kv_heads_replicated_when_fewer_than_ranks():
    spec = preset("tiny-llama")            # 8 query heads, 2 KV heads
    plans = [plan_shard(spec, 8, r) for r in range(8)]
    assert [p.kv_head0 for p in plans] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert all(p.num_kv_heads == 1 and p.num_heads == 1 for p in plans)
    # each rank's query head uses the KV head it holds (query head h uses KV head h // group)
    group = spec.num_heads // spec.num_kv_heads
    assert all(p.head0 // group == p.kv_head0 for p in plans)


@pytest.mark.parametrize("name, tp", [("llama-3-8b", 3), ("qwen2.5-7b", 8), ("tiny-qwen2", 8)])
def test_tp_that_does_not_divide_heads_is_refused(name, tp):
    with pytest.raises(ShardingError, match=f"tp={tp} does not divide num_attention_heads"):
        plan_shard(PRESETS[name], tp, 0)


class CountingWeights(CheckpointWeights):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.elements = 0

    def read(self, *a, **kw):
        t = super().read(*a, **kw)
        self.elements += t.numel()
        return t


def test_each_rank_reads_only_its_slices(saved_checkpoints):
    import json
    import os
    path = saved_checkpoints["tiny-mistral"]          # 8 KV heads: nothing replicated at tp=4
    spec = spec_from_hf_config(json.load(open(os.path.join(path, "config.json"))))
    total = spec.num_parameters()
    replicated = spec.vocab_size * spec.hidden_size + spec.hidden_size * (2 * spec.num_layers + 1)
    for rank in range(4):
        src = CountingWeights(path, spec)
        load_shard(spec, src, plan_shard(spec, 4, rank))
        assert src.elements == replicated + (total - replicated) // 4
