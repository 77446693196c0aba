"""ModelSpec: the shapes and numerics of a decoder-only LLM, read from a Hugging Face config.

Every family quirk (qkv bias, q/k-norm, explicit head_dim, rope scaling, tied embeddings, which layers are
mixture-of-experts and what their tensors are called) is decided here and nowhere else: the rest of distmk
reads flags off the spec.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from distmk.errors import ModelError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
# the checkpoint names of a sparse MLP's router and of expert j's (gate, up, down), per family
_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight",
                  "mlp.experts.{j}.down_proj.weight"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{j}.w1.weight",
                "block_sparse_moe.experts.{j}.w3.weight", "block_sparse_moe.experts.{j}.w2.weight"),
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "llama3", ...} or {}
    sliding_window: int | None = None
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # the sampling defaults a checkpoint ships (generation_config.json): temperature, top_p, top_k (0 = none)
    generation_defaults: dict = field(default_factory=dict)
    # mixture of experts: the layers whose MLP is sparse (the others are dense, of intermediate_size), each with
    # num_experts experts of moe_intermediate_size and a router picking experts_per_token of them per token;
    # norm_topk_prob: the chosen experts' probabilities are renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with a dense MLP."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)

    def moe_names(self, layer: int, expert: int) -> tuple[str, str, str, str]:
        """Checkpoint names of sparse layer `layer`'s router and of its expert's gate, up and down weights."""
        p = f"model.layers.{layer}."
        return tuple(p + name.format(j=expert) for name in _MOE_NAMES[self.family])

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies (float32), with Llama-3 frequency scaling where configured."""
        dim = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_scaling.get("rope_type") != "llama3":
            return inv
        rs = self.rope_scaling
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the Hugging Face checkpoint, by its HF name, with its full (unsharded) shape."""
        h, d = self.hidden_size, self.head_dim
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h), "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.q_size, h),
                p + "self_attn.k_proj.weight": (self.kv_size, h),
                p + "self_attn.v_proj.weight": (self.kv_size, h),
                p + "self_attn.o_proj.weight": (h, self.q_size),
            })
            if i in self.moe_layers:
                inter = self.moe_intermediate_size
                shapes[self.moe_names(i, 0)[0]] = (self.num_experts, h)
                for j in range(self.num_experts):
                    _, gate, up, down = self.moe_names(i, j)
                    shapes.update({gate: (inter, h), up: (inter, h), down: (h, inter)})
            else:
                shapes.update({p + "mlp.gate_proj.weight": (self.intermediate_size, h),
                               p + "mlp.up_proj.weight": (self.intermediate_size, h),
                               p + "mlp.down_proj.weight": (h, self.intermediate_size)})
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (self.q_size,),
                               p + "self_attn.k_proj.bias": (self.kv_size,),
                               p + "self_attn.v_proj.bias": (self.kv_size,)})
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        return shapes

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())

    def to_hf_config(self) -> dict:
        """A config.json dict that transformers reads back into the same model."""
        cfg = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) or None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "sliding_window": self.sliding_window,
            "use_sliding_window": False,
            "attention_bias": False,
            "eos_token_id": list(self.eos_token_id) or None,
            "bos_token_id": self.bos_token_id,
        }
        if self.family == "qwen3_moe":
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=1, mlp_only_layers=list(self.dense_layers))
        elif self.family == "mixtral":
            cfg.update(num_local_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                       intermediate_size=self.moe_intermediate_size)
        return cfg


def spec_from_hf_config(cfg: dict, source: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a config.json dict, with an error naming what is wrong or unsupported."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelError(f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                         f"distmk supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
    family = SUPPORTED_ARCHITECTURES[arch]

    def need(key):
        if key not in cfg or cfg[key] is None:
            raise ModelError(f"{source}: required field {key!r} is missing for {arch}")
        return cfg[key]

    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    num_heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = cfg.get("head_dim") or hidden // num_heads
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters; older configs keep them apart.
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_theta = float(rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelError(f"{source}: rope type {rope_type!r} is not supported (supported: default, llama3)")
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in rope]
        if missing:
            raise ModelError(f"{source}: llama3 rope scaling lacks {missing}")
        rope = {"rope_type": "llama3", **{k: rope[k] for k in
                ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}}
    else:
        rope = {}
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelError(f"{source}: partial_rotary_factor != 1 is not supported")
    eos = _token_ids(cfg.get("eos_token_id"), f"{source}: eos_token_id")
    if family != "qwen2" and cfg.get("attention_bias"):
        raise ModelError(f"{source}: attention_bias=true is not supported for {arch}")
    if cfg.get("mlp_bias"):
        raise ModelError(f"{source}: mlp_bias=true is not supported")
    windowed = family in ("mistral", "mixtral")          # a window over every layer, as sliding_window says
    if not windowed and cfg.get("use_sliding_window"):
        raise ModelError(f"{source}: use_sliding_window=true is not supported for {arch} (its window applies "
                         f"from layer max_window_layers on only)")
    window = cfg.get("sliding_window") if windowed else None
    num_layers = int(need("num_hidden_layers"))
    moe = _moe_fields(cfg, family, num_layers, need, source) if family in _MOE_NAMES else {}
    spec = ModelSpec(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2",  # Qwen2 always has q/k/v bias
        qk_norm=family in ("qwen3", "qwen3_moe"),
        rope_scaling=rope,
        sliding_window=int(window) if window else None,
        eos_token_id=eos,
        bos_token_id=cfg.get("bos_token_id"),
        **moe,
    )
    if spec.num_heads % spec.num_kv_heads:
        raise ModelError(f"{source}: num_attention_heads {spec.num_heads} is not a multiple of "
                         f"num_key_value_heads {spec.num_kv_heads}")
    return spec


def _moe_fields(cfg: dict, family: str, num_layers: int, need, source: str) -> dict:
    """ModelSpec's mixture-of-experts fields from a Qwen3-MoE or Mixtral config. Qwen3-MoE names its expert count
    num_experts (transformers >= 5 writes num_local_experts, as Mixtral does), its experts' width
    moe_intermediate_size (intermediate_size is its dense layers'), and picks its sparse layers by
    decoder_sparse_step and mlp_only_layers; Mixtral's layers are all sparse, its experts intermediate_size wide,
    its top-k probabilities always renormalised."""
    if cfg.get("shared_expert_intermediate_size"):
        raise ModelError(f"{source}: shared experts (shared_expert_intermediate_size) are not supported")
    experts = int(need("num_experts" if family == "qwen3_moe" and "num_experts" in cfg else "num_local_experts"))
    top_k = int(need("num_experts_per_tok"))
    if not 1 <= top_k <= experts:
        raise ModelError(f"{source}: num_experts_per_tok={top_k} must be in 1..{experts} (the number of experts)")
    if family == "mixtral":
        return dict(moe_layers=tuple(range(num_layers)), num_experts=experts, experts_per_token=top_k,
                    moe_intermediate_size=int(need("intermediate_size")), norm_topk_prob=True)
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = cfg.get("mlp_only_layers") or []
    if step < 1:
        raise ModelError(f"{source}: decoder_sparse_step must be >= 1, got {step}")
    if not all(isinstance(i, int) and 0 <= i < num_layers for i in dense):
        raise ModelError(f"{source}: mlp_only_layers must list layers in 0..{num_layers - 1}, got {dense!r}")
    return dict(moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
                num_experts=experts, experts_per_token=top_k,
                moe_intermediate_size=int(need("moe_intermediate_size")),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


def with_generation_config(spec: ModelSpec, gen: dict, source: str = "generation_config.json") -> ModelSpec:
    """The spec with what generation_config.json adds, as transformers and vLLM read it: its eos_token_id
    (an id or a list) ends generation too, and its temperature, top_p, top_k, min_p and repetition_penalty become
    the defaults."""
    eos = spec.eos_token_id + tuple(t for t in _token_ids(gen.get("eos_token_id"), f"{source}: eos_token_id")
                                    if t not in spec.eos_token_id)
    defaults = {}
    checks = {"temperature": (lambda v: v >= 0, "a finite number >= 0"),
              "top_p": (lambda v: 0 < v <= 1, "a finite number > 0 and <= 1"),
              "top_k": (lambda v: isinstance(v, int) and v >= -1, "an integer >= -1 (0 or -1: no limit)"),
              "min_p": (lambda v: 0 <= v <= 1, "a finite number >= 0 and <= 1"),
              "repetition_penalty": (lambda v: v > 0, "a finite number > 0")}
    for key, (ok, wanted) in checks.items():
        value = gen.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
            raise ModelError(f"{source}: {key} must be {wanted}, got {value!r}")
        defaults[key] = max(value, 0) if key == "top_k" else float(value)
    return dataclasses.replace(spec, eos_token_id=eos, generation_defaults=defaults)


def _token_ids(value, what: str) -> tuple[int, ...]:
    """A config's token id field: an id, a list of ids, or nothing."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ModelError(f"{what} must be a token id or a list of them, got {value!r}")
    return tuple(ids)
