"""Mixture-of-experts models (Qwen3-MoE, Mixtral): config import, experts sharded along their intermediate
dimension."""
import dataclasses

import pytest
import torch

from distmk.errors import ModelError, ShardingError
from distmk.models.presets import PRESETS, preset
from distmk.models.shard import load_shard, plan_shard
from distmk.models.spec import spec_from_hf_config
from distmk.models.weights import RandomWeights, open_model
from conftest import TINY_MOE, hf_model

# config.json of Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 on the Hugging Face Hub (the fields distmk
# reads, and the training-only ones it accepts)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 32000}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each tiny MoE preset written by transformers' save_pretrained (per-expert tensors, as on the Hub)."""
    root = tmp_path_factory.mktemp("moe")
    for name in TINY_MOE:
        hf_model(name).save_pretrained(root / name)
    return {name: str(root / name) for name in TINY_MOE}


def test_presets_have_transformers_parameter_counts_and_real_sizes():
    for name in TINY_MOE:
        assert PRESETS[name].num_parameters() == sum(p.numel() for p in hf_model(name).parameters())
    assert PRESETS["qwen3-30b-a3b"].num_parameters() / 1e9 == pytest.approx(30.53, abs=0.01)
    assert PRESETS["mixtral-8x7b"].num_parameters() / 1e9 == pytest.approx(46.70, abs=0.01)


def test_hub_configs_give_the_real_presets():
    assert dataclasses.replace(spec_from_hf_config(QWEN3_30B_A3B), bos_token_id=None) == PRESETS["qwen3-30b-a3b"]
    assert spec_from_hf_config(MIXTRAL_8X7B) == PRESETS["mixtral-8x7b"]


def test_checkpoint_round_trip(checkpoints):
    """The config transformers writes (num_local_experts for Qwen3-MoE too) reads back into the preset, and an
    expert's tensors under the checkpoint's names are the preset's."""
    for name, path in checkpoints.items():
        spec, source, _ = open_model(path)
        assert spec == PRESETS[name]
        down = spec.moe_names(spec.moe_layers[-1], spec.num_experts - 1)[3]
        assert torch.equal(source.read(down, 1, 8, 24), RandomWeights(spec).read(down, 1, 8, 24))


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    spec = spec_from_hf_config(cfg)
    assert spec.moe_layers == (1, 5) and spec.dense_layers == (0, 2, 3, 4)
    assert spec_from_hf_config(spec.to_hf_config()).moe_layers == (1, 5)


@pytest.mark.parametrize("changes, message", [
    ({"shared_expert_intermediate_size": 512}, "shared experts .* not supported"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok=129 must be in 1..128"),
    ({"mlp_only_layers": [48]}, r"mlp_only_layers must list layers in 0..47, got \[48\]"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1"),
    ({"moe_intermediate_size": None}, "required field 'moe_intermediate_size' is missing"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
])
def test_unsupported_or_broken_moe_fields_are_refused_by_name(changes, message):
    with pytest.raises(ModelError, match=message):
        spec_from_hf_config({**QWEN3_30B_A3B, **changes})


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TINY_MOE)
def test_every_rank_holds_its_rows_of_every_expert(name, tp):
    """Experts split along their intermediate dimension: the ranks' rows of gate/up and columns of down put
    together are each expert; the router is every rank's."""
    spec = preset(name)
    source = RandomWeights(spec)
    shards = [load_shard(spec, source, plan_shard(spec, tp, rank)) for rank in range(tp)]
    for i, layer in enumerate(spec.moe_layers):
        assert all(s.layers[layer].w_gate is None for s in shards)
        router = spec.moe_names(layer, 0)[0]
        assert all(torch.equal(s.layers[layer].router, source.full(router)) for s in shards)
        for expert in range(spec.num_experts):
            _, gate, up, down = spec.moe_names(layer, expert)
            for field, name_, dim in (("expert_gate", gate, 0), ("expert_up", up, 0), ("expert_down", down, 1)):
                joined = torch.cat([getattr(s.layers[layer], field)[expert] for s in shards], dim=dim)
                assert torch.equal(joined, source.full(name_)), (layer, expert, field)
    for layer in spec.dense_layers:
        assert torch.equal(torch.cat([s.layers[layer].w_gate for s in shards]),
                           source.full(f"model.layers.{layer}.mlp.gate_proj.weight"))


def test_tp_that_does_not_divide_the_experts_is_refused():
    spec = dataclasses.replace(preset("tiny-mixtral"), moe_intermediate_size=30)
    with pytest.raises(ShardingError, match="tp=4 does not divide the experts' intermediate size 30"):
        plan_shard(spec, 4, 0)
