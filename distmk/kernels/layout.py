"""The weight layout the megakernel reads: each per-layer weight stacked into one [layers, ...] tensor, so
a task finds layer l's matrix at a fixed offset from one kernel argument. The rank's LayerWeights are
rebound to views of the stacked tensors, so the reference executor and the kernel share one copy. A product held
in e4m3 alone (RankWeights.fp8) is a placeholder here: the kernels take its e4m3 values.

The router and experts are stacked over the sparse layers only ([sparse layers, experts, ...]: a sparse
layer's tasks carry its index among them), the dense MLP over every layer, with zeros in the sparse ones
where a model has both kinds (Qwen3-MoE's mlp_only_layers), so the dense tiles keep their offsets."""
from __future__ import annotations

import torch

from distmk.models.shard import RankWeights


# the products the megakernels may stream in e4m3 (RankWeights.fp8), each with its scales `<name>_scale`
FP8_PRODUCTS = ("wqkv", "wo", "w_gate", "w_up", "w_down", "expert_gate", "expert_up", "expert_down")
# the tensors stack_layers returns, by name (kernels/interface.py declares them as kernel arguments)
STACKED = ("embed", "wqkv", "bqkv", "qk_norm", "wo", "w_gate", "w_up", "w_down", "norms", "lm_head", "router",
           "expert_gate", "expert_up", "expert_down", *(f"{name}_scale" for name in FP8_PRODUCTS))


def stack_layers(weights: RankWeights) -> dict[str, torch.Tensor]:
    """The stacked tensors, built once per RankWeights (every executor of an engine shares them)."""
    if weights.stacked is None:
        weights.stacked = _stack(weights)
    return weights.stacked


def _stack(weights: RankWeights) -> dict[str, torch.Tensor]:
    layers = weights.layers
    out = {}
    placeholder = torch.zeros(1, dtype=weights.embed.dtype, device=weights.embed.device)

    def stack(name, fields):
        if name in weights.fp8:         # held in e4m3 alone: the kernels take those values (kernels/executor.py)
            out[name] = placeholder
            return
        stacked = torch.stack([torch.stack([getattr(lw, f) for f in fields]) for lw in layers])
        for lw, per_layer in zip(layers, stacked):
            for f, view in zip(fields, per_layer):
                setattr(lw, f, view)
        out[name] = stacked

    for name in ("wqkv", "wo"):
        stack(name, [name])
    dense = [lw for lw in layers if lw.router is None]
    sparse = [lw for lw in layers if lw.router is not None]
    for name in ("w_gate", "w_up", "w_down"):
        if dense and name not in weights.fp8:
            zeros = torch.zeros_like(getattr(dense[0], name))
            out[name] = torch.stack([zeros if lw.router is not None else getattr(lw, name) for lw in layers])
            for lw, view in zip(layers, out[name]):
                if lw.router is None:
                    setattr(lw, name, view)
        else:
            out[name] = placeholder
    for name in ("router", "expert_gate", "expert_up", "expert_down"):
        out[name] = stack_in_place(sparse, name) if sparse and name not in weights.fp8 else placeholder
    if layers[0].bqkv is not None:
        stack("bqkv", ["bqkv"])
    else:
        out["bqkv"] = placeholder
    if layers[0].q_norm is not None:
        stack("qk_norm", ["q_norm", "k_norm"])          # [layers, 2, D]
    else:
        out["qk_norm"] = placeholder
    out["norms"] = torch.stack([n for lw in layers for n in (lw.input_norm, lw.post_norm)] + [weights.final_norm])
    out.update(embed=weights.embed, lm_head=weights.lm_head)
    scale_placeholder = torch.zeros(1, dtype=torch.float32, device=weights.embed.device)
    for name in FP8_PRODUCTS:
        out[f"{name}_scale"] = weights.fp8[name][1] if name in weights.fp8 else scale_placeholder
    return out


def stack_in_place(layers, name: str) -> torch.Tensor:
    """getattr(lw, name) of every layer stacked into one tensor: the tensor they are already views of, in order
    (load_shard's experts), else a new one, each layer's field rebound to its view as it is copied, so its own
    tensor is freed then (torch.stack would hold them twice until it returned)."""
    first = getattr(layers[0], name)
    base = first._base
    if base is not None and base.shape == (len(layers), *first.shape) and base.is_contiguous() and all(
            getattr(lw, name).data_ptr() == view.data_ptr() for lw, view in zip(layers, base)):
        return base
    stacked = first.new_empty((len(layers), *first.shape))
    for lw, view in zip(layers, stacked):
        view.copy_(getattr(lw, name))
        setattr(lw, name, view)
    return stacked
