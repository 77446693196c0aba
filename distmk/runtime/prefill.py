"""Prompt prefill as matrix products: a chunk of one sequence's prompt runs through every layer as torch GEMMs
(cuBLAS on a GPU) with scaled_dot_product_attention over the paged KV cache, and writes that cache exactly where
the decode graph's tasks read it. The decode megakernel is a GEMV machine of at most a step's rows (16): a
2000-token prompt through it took 1.26 s on an H200, where its matmuls need some 45 ms of tensor-core time.

Numerics follow the graph's tasks (tasks/): the residual stream in float32, activations rounded to the model's
dtype where a task stores them, RMSNorm and RoPE in float32; the products run in the model's dtype (in bf16,
cuBLAS accumulates in float32 and rounds each output once, where the tasks keep float32 until they store).
Under tensor parallelism every rank runs its shard and the row-parallel outputs are summed in rank order
(comm.gather), so the ranks stay bit-identical. A sparse layer routes and combines as its tasks do.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from distmk.comm import sum_in_rank_order
from distmk.tasks.base import rms_norm, rope
from distmk.tasks.moe_combine import weighted_sum
from distmk.tasks.route import choose


def prefill_chunk(engine, tokens: list[int], start: int, blocks: list[int]) -> None:
    """Write the KV entries of `tokens`, at positions start..start + len(tokens) - 1 of the sequence whose KV
    blocks are `blocks` (positions before `start` are in the cache already). Every rank calls it together."""
    spec, plan, weights, kv, dtype = engine.spec, engine.plan, engine.weights, engine.kv, engine.dtype
    device = kv.k.device
    n, d, hq, hkv = len(tokens), spec.head_dim, plan.num_heads, plan.num_kv_heads
    positions = torch.arange(start, start + n, device=device)
    table = torch.as_tensor(blocks, dtype=torch.int64, device=device)
    cached = torch.arange(start + n, device=device)                       # every position the chunk may see
    page, slot = table[positions // kv.block_size], positions % kv.block_size
    if spec.sliding_window:
        keep = (cached[None, :] <= positions[:, None]) & (cached[None, :] > positions[:, None] - spec.sliding_window)
    else:
        # causal from the chunk's last row back (query i sees the keys up to start + i): a bias object, not a
        # tensor, so that scaled_dot_product_attention runs a fused kernel; a boolean mask sends it to its
        # math kernel, which materialises every score (in float32 for bf16 inputs)
        keep = causal_lower_right(n, start + n)
    x = weights.embed[torch.as_tensor(tokens, device=device)].float()     # [n, H] residual stream
    for layer, lw in enumerate(weights.layers):
        qkv = F.linear(rms_norm(x, lw.input_norm, spec.rms_norm_eps).to(dtype), lw.wqkv).float()
        if lw.bqkv is not None:
            qkv = qkv + lw.bqkv.float()
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
        if spec.qk_norm:
            q, k = rms_norm(q, lw.q_norm, spec.rms_norm_eps), rms_norm(k, lw.k_norm, spec.rms_norm_eps)
        q = rope(q, positions, weights.inv_freq).to(dtype)
        kv.k[layer, page, slot] = rope(k, positions, weights.inv_freq).to(dtype)
        kv.v[layer, page, slot] = v.to(dtype)
        if layer == len(weights.layers) - 1:
            break                       # the chunk's output is its KV entries: the last layer's end feeds nothing
        seen = table[cached // kv.block_size], cached % kv.block_size
        # the kv heads repeated for their query heads: the fused kernels that take a causal bias do not take GQA
        # ([1, heads, positions, D]: the fused kernels take the batch dimension)
        keys, values = (cache[layer][seen].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
                        for cache in (kv.k, kv.v))
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values, attn_mask=keep)
        attn = attn[0].transpose(0, 1).reshape(n, hq * d)
        x = x + sum_in_rank_order(engine.comm, F.linear(attn, lw.wo).float())
        xn = rms_norm(x, lw.post_norm, spec.rms_norm_eps).to(dtype)
        if lw.router is None:
            h = (F.silu(F.linear(xn, lw.w_gate).float()) * F.linear(xn, lw.w_up).float()).to(dtype)
            mlp = F.linear(h, lw.w_down).float()
        else:
            mlp = sparse_mlp(xn, lw, spec)
        x = x + sum_in_rank_order(engine.comm, mlp)


def sparse_mlp(xn: torch.Tensor, lw, spec) -> torch.Tensor:
    """A sparse layer's MLP output (this rank's partial sum, float32) for normed rows `xn`, as its tasks compute
    it: the router's choices, each chosen expert's products over the rows that chose it, and the weighted sum
    in the order of the choices."""
    weights, experts = choose(xn.float() @ lw.router.float().t(), spec.experts_per_token, spec.norm_topk_prob)
    outs = torch.zeros(*experts.shape, spec.hidden_size, dtype=torch.float32, device=xn.device)
    for expert in experts.unique().tolist():
        rows, choices = (experts == expert).nonzero(as_tuple=True)
        h = (F.silu(F.linear(xn[rows], lw.expert_gate[expert]).float())
             * F.linear(xn[rows], lw.expert_up[expert]).float()).to(xn.dtype)
        outs[rows, choices] = F.linear(h, lw.expert_down[expert]).float()
    return weighted_sum(weights, outs)

