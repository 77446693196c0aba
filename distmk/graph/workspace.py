"""The activation buffers that tasks read and write, by name: one set per rank, reused every step."""
from __future__ import annotations

import torch

from distmk.graph.lowering import num_lm_tiles


def allocate_workspace(spec, plan, config, dtype, device) -> dict:
    """Buffers for a table compiled with `config` (its batch, attention splits and lm_head tiles)."""
    B, H, D, g = config.batch, spec.hidden_size, spec.head_dim, plan.group
    kv_splits, lm_tiles = config.kv_splits, num_lm_tiles(plan, config)
    f32 = dict(dtype=torch.float32, device=device)
    act = dict(dtype=dtype, device=device)
    return {
        "x": torch.zeros(B, H, **f32),                               # residual stream, kept in float32
        "q": torch.zeros(B, plan.num_heads, D, **act),               # roped queries
        "qk_raw": torch.zeros(B, plan.num_heads + plan.num_kv_heads, D, **f32),  # q/k heads before q/k-norm
        "attn_o": torch.zeros(B, plan.num_kv_heads, kv_splits, g, D, **f32),  # split-KV partials
        "attn_m": torch.zeros(B, plan.num_kv_heads, kv_splits, g, **f32),
        "attn_l": torch.zeros(B, plan.num_kv_heads, kv_splits, g, **f32),
        "attn": torch.zeros(B, plan.num_heads * D, **act),           # attention output, heads concatenated
        "partial": torch.zeros(B, H, **f32),                         # this rank's row-parallel partial sum
        "h": torch.zeros(B, plan.inter, **act),                      # silu(gate) * up
        "logits": torch.zeros(B, plan.vocab, **f32),                 # this rank's vocabulary slice
        "tile_max": torch.zeros(B, lm_tiles, **f32),
        "tile_arg": torch.zeros(B, lm_tiles, dtype=torch.int64, device=device),
        "next_token": torch.zeros(B, dtype=torch.int64, device=device),
    }
