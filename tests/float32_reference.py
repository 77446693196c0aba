"""A float32 forward pass over one rank's weights (tp=1), written from the models' definitions rather than from
distmk's tasks: what the GPU tests compare a bf16 model's logits with when transformers' float32 copy would not
fit beside distmk's (qwen3-30b-a3b: 120 GB in float32). Each tensor is upcast where it is used, layer by layer,
and of a sparse layer's experts only those a token chose, so it holds little more than the weights it is given
(distmk's own bf16 ones: the float32 model of the same bf16-rounded weights).

Routing is discontinuous: where a token's k-th and (k+1)-th experts are nearly tied, bf16 rounding upstream
picks the other one, and with random weights such near-ties are common (qwen3-30b-a3b cut to 4 layers, bf16
rounding as distmk's reference executor has it: 2 to 9 of 24 tokens per layer chose differently and the
logits moved 10%, where a dense qwen3-8b cut the same way moved 0.8%). So the reference can also take the
experts from outside (`routes`: distmk's, from its workspace's route_history), which leaves rounding as the
only difference."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def exact_float32():
    """float32 products in float32, not TF32, whatever the process set."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _sparse_mlp(spec, lw, h: torch.Tensor, experts: torch.Tensor | None = None):
    """Softmax over all experts, the top k (or the given experts [tokens, k]), their probabilities renormalised if
    the model says so; each chosen expert over the tokens that chose it, weighted. Returns (output, experts)."""
    probs = torch.softmax(h @ lw.router.float().t(), dim=-1)
    if experts is None:
        weights, experts = torch.topk(probs, spec.experts_per_token, dim=-1)
    else:
        experts = experts.to(h.device)
        weights = probs.gather(-1, experts)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(h)
    for expert in experts.unique().tolist():
        rows, choice = (experts == expert).nonzero(as_tuple=True)
        x = h[rows]
        y = (F.silu(x @ lw.expert_gate[expert].float().t()) * (x @ lw.expert_up[expert].float().t())
             ) @ lw.expert_down[expert].float().t()
        out.index_add_(0, rows, weights[rows, choice, None] * y)
    return out, experts


@torch.no_grad()
def float32_logits(spec, weights, tokens: list[int], routes: torch.Tensor | None = None,
                   return_routes: bool = False):
    """[len(tokens), vocab] float32 logits of every position of one sequence (causal attention over the tokens
    before it, within the sliding window), from `weights` (a tp=1 RankWeights, any dtype, on any device).
    `routes` [sparse layers, len(tokens), top_k]: each sparse layer's experts for each position, instead of its
    own choice; with return_routes, also the experts it used, in that shape."""
    if weights.plan.tp != 1:
        raise ValueError("the float32 reference runs the whole model (tp=1)")
    device = weights.embed.device
    n, d, hq, hkv, eps = len(tokens), spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.rms_norm_eps
    positions = torch.arange(n, device=device)
    freqs = positions[:, None].float() * spec.inv_freq().to(device)[None, :]
    cos, sin = (f(torch.cat([freqs, freqs], dim=-1))[:, None, :] for f in (torch.cos, torch.sin))   # [n, 1, D]
    visible = positions[None, :] <= positions[:, None]                                             # [query, key]
    if spec.sliding_window:
        visible &= positions[None, :] > positions[:, None] - spec.sliding_window
    used = []
    with exact_float32():
        x = weights.embed[torch.as_tensor(tokens, device=device)].float()
        for lw in map(weights.layer, range(len(weights.layers))):
            qkv = _rms_norm(x, lw.input_norm, eps) @ lw.wqkv.float().t()
            if lw.bqkv is not None:
                qkv = qkv + lw.bqkv.float()
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
            if lw.q_norm is not None:
                q, k = _rms_norm(q, lw.q_norm, eps), _rms_norm(k, lw.k_norm, eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            attn = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, hq * d)
            x = x + attn @ lw.wo.float().t()
            h = _rms_norm(x, lw.post_norm, eps)
            if lw.router is None:
                x = x + (F.silu(h @ lw.w_gate.float().t()) * (h @ lw.w_up.float().t())) @ lw.w_down.float().t()
            else:
                out, experts = _sparse_mlp(spec, lw, h, None if routes is None else routes[len(used)])
                used.append(experts)
                x = x + out
        logits = _rms_norm(x, weights.final_norm, eps) @ weights.lm_head[:spec.vocab_size].float().t()
    if return_routes:
        return logits, (torch.stack(used) if used else torch.zeros(0, n, 0, dtype=torch.int64, device=device))
    return logits
