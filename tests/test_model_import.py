"""Model import: presets, Hugging Face configs of every family, and clear errors for broken input."""
import json
import os
import shutil

import pytest
import torch

from distmk.errors import ModelError
from distmk.models.presets import PRESETS
from distmk.models.shard import load_shard, plan_shard
from distmk.models.weights import CheckpointWeights, RandomWeights, open_model
from conftest import TINY, hf_model


def test_preset_shapes_match_transformers_parameter_count():
    for name in TINY:
        spec = PRESETS[name]
        hf = hf_model(name)
        assert spec.num_parameters() == sum(p.numel() for p in hf.parameters())
        assert 0.1e6 < spec.num_parameters() * 4 < 8e6          # "a few MB"


@pytest.mark.parametrize("name, billions", [("llama-3-8b", 8.03), ("qwen3-8b", 8.19), ("mistral-7b", 7.25),
                                            ("qwen2.5-7b", 7.62), ("llama-3.2-1b", 1.24), ("qwen3-0.6b", 0.60)])
def test_real_presets_have_real_sizes(name, billions):
    assert PRESETS[name].num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)


def test_checkpoint_config_round_trip(saved_checkpoints):
    for name, path in saved_checkpoints.items():
        spec, source, tokenizer_dir = open_model(path)
        assert spec == PRESETS[name]
        assert isinstance(source, CheckpointWeights) and tokenizer_dir is None
        want = RandomWeights(spec).read("model.layers.1.mlp.down_proj.weight", 1, 8, 24)
        assert torch.equal(source.read("model.layers.1.mlp.down_proj.weight", 1, 8, 24), want)


def test_llama3_rope_scaling_and_old_style_config():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 4, "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}
    from distmk.models.spec import spec_from_hf_config
    spec = spec_from_hf_config(cfg)
    assert spec.num_kv_heads == 4 and spec.head_dim == 16 and spec.rope_theta == 500000.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    assert torch.allclose(spec.inv_freq(), inv)


def write_ckpt(tmp_path, name="tiny-llama"):
    path = tmp_path / name
    hf_model(name).save_pretrained(path)
    return path


def test_unsupported_architecture(tmp_path):
    path = write_ckpt(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*supports Llama"):
        open_model(str(path))


@pytest.mark.parametrize("damage, message", [
    (lambda p: os.remove(p / "config.json"), "no config.json"),
    (lambda p: (p / "config.json").write_text("{not json"), "invalid JSON"),
    (lambda p: (p / "config.json").write_text("[1, 2]"), r"config.json: must hold a JSON object, not list \[1, 2\]"),
    (lambda p: (p / "generation_config.json").write_text('"x"'), "generation_config.json: must hold a JSON object"),
    (lambda p: (p / "generation_config.json").write_text('{"eos_token_id": "2"}'),
     "generation_config.json: eos_token_id must be a token id or a list of them, got '2'"),
    (lambda p: (p / "generation_config.json").write_text('{"temperature": NaN}'),
     "generation_config.json: temperature must be a finite number >= 0, got nan"),
    (lambda p: (p / "generation_config.json").write_text('{"top_p": 0}'),
     "generation_config.json: top_p must be a finite number > 0 and <= 1, got 0"),
    (lambda p: [os.remove(f) for f in p.glob("*.safetensors")], "no \\*.safetensors file"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage"), "cannot read safetensors"),
    (lambda p: _edit_config(p, hidden_size=64), "has shape .* config.json implies"),
    (lambda p: _edit_config(p, num_hidden_layers=3), "lacks .* tensor"),
    (lambda p: _edit_config(p, num_attention_heads=None), "required field 'num_attention_heads' is missing"),
    (lambda p: _edit_config(p, rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn'"),
    (lambda p: _edit_config(p, use_sliding_window=True), "use_sliding_window=true is not supported"),
])
def test_broken_checkpoint_errors(tmp_path, damage, message):
    path = write_ckpt(tmp_path)
    damage(path)
    with pytest.raises(ModelError, match=message):
        open_model(str(path))


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_sharded_index_naming_a_missing_file(tmp_path):
    path = tmp_path / "sharded"
    hf_model("tiny-llama").save_pretrained(path, max_shard_size="200KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shutil.move(shard, tmp_path / "elsewhere.safetensors")
    with pytest.raises(ModelError, match=f"names {shard.name}, which does not exist"):
        open_model(str(path))


def test_unknown_preset_lists_presets():
    with pytest.raises(ModelError, match="presets: llama-3-8b, llama-3.2-1b"):
        open_model("llama-9")


def test_bfloat16_shard():
    spec = PRESETS["tiny-qwen2"]
    shard = load_shard(spec, RandomWeights(spec), plan_shard(spec, 2, 1), dtype=torch.bfloat16)
    assert shard.layers[0].wqkv.dtype == torch.bfloat16 and shard.inv_freq.dtype == torch.float32
