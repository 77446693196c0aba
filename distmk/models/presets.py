"""Named model shapes: real ones (for benchmarks, with seeded random weights) and tiny ones (for tests)."""
from __future__ import annotations

from distmk.errors import ModelError
from distmk.models.spec import ModelSpec

_LLAMA3_SCALING_1B = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}

PRESETS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("LlamaForCausalLM", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 8192,
                            eos_token_id=(128001,), bos_token_id=128000),
    "llama-3.2-1b": ModelSpec("LlamaForCausalLM", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, 131072,
                              tie_word_embeddings=True, rope_scaling=_LLAMA3_SCALING_1B,
                              eos_token_id=(128001, 128008, 128009), bos_token_id=128000),
    "qwen3-8b": ModelSpec("Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6, 1000000.0, 40960,
                          qk_norm=True, eos_token_id=(151645,)),
    "qwen3-0.6b": ModelSpec("Qwen3ForCausalLM", 151936, 1024, 3072, 28, 16, 8, 128, 1e-6, 1000000.0, 40960,
                            tie_word_embeddings=True, qk_norm=True, eos_token_id=(151645,)),
    "qwen2.5-7b": ModelSpec("Qwen2ForCausalLM", 152064, 3584, 18944, 28, 28, 4, 128, 1e-6, 1000000.0, 32768,
                            qkv_bias=True, eos_token_id=(151645,)),
    "mistral-7b": ModelSpec("MistralForCausalLM", 32768, 4096, 14336, 32, 32, 8, 128, 1e-5, 1000000.0, 32768,
                            eos_token_id=(2,), bos_token_id=1),
    # mixtures of experts: every layer sparse (qwen3-30b-a3b: 128 experts of 768 rows, top 8, renormalised)
    "qwen3-30b-a3b": ModelSpec("Qwen3MoeForCausalLM", 151936, 2048, 6144, 48, 32, 4, 128, 1e-6, 1000000.0, 40960,
                               qk_norm=True, eos_token_id=(151645,), moe_layers=tuple(range(48)), num_experts=128,
                               experts_per_token=8, moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral-8x7b": ModelSpec("MixtralForCausalLM", 32000, 4096, 14336, 32, 32, 8, 128, 1e-5, 1000000.0, 32768,
                              eos_token_id=(2,), bos_token_id=1, moe_layers=tuple(range(32)), num_experts=8,
                              experts_per_token=2, moe_intermediate_size=14336, norm_topk_prob=True),
    # A few MB each; shapes chosen so that tp=4 splits heads and replicates KV heads, and so that every
    # family quirk is exercised: llama3 rope scaling, explicit head_dim != hidden/heads, q/k-norm, qkv bias.
    "tiny-llama": ModelSpec("LlamaForCausalLM", 512, 128, 256, 2, 8, 2, 16, 1e-5, 500000.0, 1024,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "tiny-qwen3": ModelSpec("Qwen3ForCausalLM", 512, 128, 256, 2, 8, 4, 32, 1e-6, 1000000.0, 1024,
                            tie_word_embeddings=True, qk_norm=True),
    "tiny-qwen2": ModelSpec("Qwen2ForCausalLM", 512, 128, 384, 2, 4, 2, 32, 1e-6, 1000000.0, 1024,
                            qkv_bias=True),
    "tiny-mistral": ModelSpec("MistralForCausalLM", 512, 128, 256, 2, 8, 8, 16, 1e-5, 1000000.0, 1024),
    # A few MB each. tiny-qwen3-moe: a dense layer between two sparse ones (mlp_only_layers), top 4 of 8
    # experts without renormalisation, a group of 8 query heads per KV head as qwen3-30b-a3b's (two attention
    # tasks each: tasks/attention.py attention_heads); tiny-mixtral: top 2 of 4 experts (rows of a batch often
    # share one), renormalised. Hidden size and MLP width as the dense tiny presets' (128, 256).
    "tiny-qwen3-moe": ModelSpec("Qwen3MoeForCausalLM", 512, 128, 128, 3, 8, 1, 32, 1e-6, 1000000.0, 1024,
                                qk_norm=True, moe_layers=(0, 2), num_experts=8, experts_per_token=4,
                                moe_intermediate_size=256),
    "tiny-mixtral": ModelSpec("MixtralForCausalLM", 512, 128, 256, 2, 4, 4, 32, 1e-5, 1000000.0, 1024,
                              moe_layers=(0, 1), num_experts=4, experts_per_token=2, moe_intermediate_size=256,
                              norm_topk_prob=True),
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}: not a checkpoint directory and not a preset "
                         f"(presets: {', '.join(PRESETS)})") from None
