"""Prompt prefill as matrix products: a chunk of one sequence's prompt runs through every layer as torch GEMMs
(cuBLAS on a GPU) with scaled_dot_product_attention over the paged KV cache, and writes that cache exactly where
the decode graph's tasks read it. The decode megakernel is a GEMV machine of at most a step's rows (16): a
2000-token prompt through it took 1.26 s on an H200, where its matmuls need some 45 ms of tensor-core time.

On a GPU the element-wise work between the products (residual adds, RMSNorm, RoPE, SiLU) runs torch.compile'd,
one fused kernel per stage: op by op, a chunk is some 60 kernel launches a layer, which at 256 tokens cost more
than its products (the eager chunk of 256 took 42 ms on an H200, the products alone about 4).

Numerics follow the graph's tasks (tasks/): the residual stream in float32, activations rounded to the model's
dtype where a task stores them, RMSNorm and RoPE in float32; the products run in the model's dtype (in bf16,
cuBLAS accumulates in float32 and rounds each output once, where the tasks keep float32 until they store).
Under tensor parallelism every rank runs its shard and the row-parallel outputs are summed in rank order
(comm.gather), so the ranks stay bit-identical. A sparse layer routes and combines as its tasks do.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from distmk.comm import sum_in_rank_order
from distmk.tasks.base import rms_norm
from distmk.tasks.moe_combine import weighted_sum
from distmk.tasks.route import choose


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """tasks.base.rope with the chunk's angles computed once: x [rows, heads, D], cos and sin [rows, 1, D]."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    return x32 * cos + torch.cat((-x32[..., half:], x32[..., :half]), dim=-1) * sin


def attention_inputs(x, delta, norm, wqkv, bqkv, q_norm, k_norm, cos, sin, heads: tuple[int, int, int],
                     eps: float, dtype):
    """The residual stream after the last layer's MLP (`delta`, None before the first layer) and this layer's
    rotated q, k and v in the model's dtype."""
    hq, hkv, d = heads
    if delta is not None:
        x = x + delta.float()
    qkv = F.linear(rms_norm(x, norm, eps).to(dtype), wqkv).float()
    if bqkv is not None:
        qkv = qkv + bqkv.float()
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    return x, rotate(q, cos, sin).to(dtype), rotate(k, cos, sin).to(dtype), v.to(dtype)


def residual_norm(x, delta, norm, eps: float, dtype):
    """The residual stream after attention and its RMSNorm in the model's dtype (the MLP's input)."""
    x = x + delta.float()
    return x, rms_norm(x, norm, eps).to(dtype)


def dense_mlp(xn, w_gate, w_up, w_down):
    """A dense layer's MLP output, this rank's partial sum in the model's dtype."""
    h = (F.silu(F.linear(xn, w_gate).float()) * F.linear(xn, w_up).float()).to(xn.dtype)
    return F.linear(h, w_down)


@functools.cache
def stages(compiled: bool):
    """The element-wise stages, torch.compile'd (dynamic in the chunk's length: one compilation serves every
    chunk) or as they are."""
    funcs = attention_inputs, residual_norm, dense_mlp
    return tuple(torch.compile(f, dynamic=True) for f in funcs) if compiled else funcs


def prefill_chunk(engine, tokens: list[int], start: int, blocks: list[int]) -> None:
    """Write the KV entries of `tokens`, at positions start..start + len(tokens) - 1 of the sequence whose KV
    blocks are `blocks` (positions before `start` are in the cache already). Every rank calls it together."""
    spec, plan, weights, kv, dtype = engine.spec, engine.plan, engine.weights, engine.kv, engine.dtype
    device = kv.k.device
    n, heads, eps = len(tokens), (plan.num_heads, plan.num_kv_heads, spec.head_dim), spec.rms_norm_eps
    hq, hkv, d = heads
    qkv_stage, norm_stage, mlp_stage = stages(engine.compile_prefill)
    positions = torch.arange(start, start + n, device=device)
    freqs = positions.float()[:, None] * weights.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    table = torch.as_tensor(blocks, dtype=torch.int64, device=device)
    page, slot = table[positions // kv.block_size], positions % kv.block_size
    cached = torch.arange(start + n, device=device)                       # every position the chunk may see
    seen = table[cached // kv.block_size], cached % kv.block_size
    if spec.sliding_window:
        keep = (cached[None, :] <= positions[:, None]) & (cached[None, :] > positions[:, None] - spec.sliding_window)
    else:
        # causal from the chunk's last row back (query i sees the keys up to start + i): a bias object, not a
        # tensor, so that scaled_dot_product_attention runs a fused kernel; a boolean mask sends it to its
        # math kernel, which materialises every score (in float32 for bf16 inputs)
        keep = causal_lower_right(n, start + n)
    x = weights.embed[torch.as_tensor(tokens, device=device)].float()     # [n, H] residual stream
    delta = None                                                          # the last MLP's output, summed
    for layer, lw in enumerate(weights.layers):
        x, q, k, v = qkv_stage(x, delta, lw.input_norm, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm, cos, sin, heads,
                               eps, dtype)
        kv.k[layer, page, slot] = k
        kv.v[layer, page, slot] = v
        if layer == len(weights.layers) - 1:
            break                       # the chunk's output is its KV entries: the last layer's end feeds nothing
        q = q.transpose(0, 1)[None]                                       # [1, heads, positions, D]
        if start == 0 and not spec.sliding_window:
            # the chunk's own keys are all it sees: causal from the top left, the kv heads shared by their query
            # heads inside the fused kernel
            attn = F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                                  is_causal=True, enable_gqa=True)
        else:
            # the kv heads repeated for their query heads: the fused kernels that take a causal bias do not take GQA
            keys, values = (cache[layer][seen].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
                            for cache in (kv.k, kv.v))
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep)
        attn = attn[0].transpose(0, 1).reshape(n, hq * d)
        x, xn = norm_stage(x, sum_in_rank_order(engine.comm, F.linear(attn, lw.wo).float()), lw.post_norm, eps,
                           dtype)
        mlp = mlp_stage(xn, lw.w_gate, lw.w_up, lw.w_down) if lw.router is None else sparse_mlp(xn, lw, spec)
        delta = sum_in_rank_order(engine.comm, mlp.float())


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
