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

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from distmk.comm import sum_in_rank_order
from distmk.tasks.base import rms_norm, rope_angles, rotate
from distmk.tasks.moe_combine import weighted_sum
from distmk.tasks.route import choose


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
    graphs = engine.prefill_graphs
    if start == 0 and graphs is not None and len(tokens) <= graphs.sizes[-1]:
        graphs.run(tokens, blocks)
        return
    spec, kv, device = engine.spec, engine.kv, engine.kv.k.device
    n, hq, hkv = len(tokens), engine.plan.num_heads, engine.plan.num_kv_heads
    positions = torch.arange(start, start + n, device=device)
    table = torch.as_tensor(blocks, dtype=torch.int64, device=device)
    page, slot = table[positions // kv.block_size], positions % kv.block_size
    if start == 0 and not spec.sliding_window:
        attend = own_keys
    else:
        cached = torch.arange(start + n, device=device)                   # every position the chunk may see
        seen = table[cached // kv.block_size], cached % kv.block_size
        if spec.sliding_window:
            keep = ((cached[None, :] <= positions[:, None])
                    & (cached[None, :] > positions[:, None] - spec.sliding_window))
        else:
            # causal from the chunk's last row back (query i sees the keys up to start + i): a bias object, not
            # a tensor, so that scaled_dot_product_attention runs a fused kernel; a boolean mask sends it to
            # its math kernel, which materialises every score (in float32 for bf16 inputs)
            keep = causal_lower_right(n, start + n)

        def attend(layer, q, k, v):
            # the kv heads repeated for their query heads: the fused kernels that take a causal bias do not
            # take GQA
            keys, values = (cache[layer][seen].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None]
                            for cache in (kv.k, kv.v))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=keep)
    run_layers(engine, torch.as_tensor(tokens, device=device), positions, page, slot, attend)


def own_keys(layer, q, k, v):
    """Attention of a first chunk, which sees its own keys alone: causal from the top left, the kv heads
    shared by their query heads inside the fused kernel ([1, heads, positions, D] each)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def run_layers(engine, ids, positions, page, slot, attend, stored=None):
    """The chunk's rows through every layer: tokens `ids` at `positions`, their K and V written to the cache's
    (page, slot); attend(layer, q, k, v) gives the attention of the rows' queries [1, heads, rows, D]. stored:
    the row whose K and V each cache write takes (default: its own)."""
    spec, plan, weights, kv, dtype = engine.spec, engine.plan, engine.weights, engine.kv, engine.dtype
    n, heads, eps = ids.shape[0], (plan.num_heads, plan.num_kv_heads, spec.head_dim), spec.rms_norm_eps
    qkv_stage, norm_stage, mlp_stage = stages(engine.compile_prefill)
    cos, sin = rope_angles(positions, weights.inv_freq)
    x = weights.embed[ids].float()                                        # [n, H] residual stream
    delta = None                                                          # the last MLP's output, summed
    for layer, lw in enumerate(weights.layers):
        x, q, k, v = qkv_stage(x, delta, lw.input_norm, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm, cos, sin, heads,
                               eps, dtype)
        kv.k[layer, page, slot] = k if stored is None else k[stored]
        kv.v[layer, page, slot] = v if stored is None else v[stored]
        if layer == len(weights.layers) - 1:
            break                       # the chunk's output is its KV entries: the last layer's end feeds nothing
        attn = attend(layer, *(t.transpose(0, 1)[None] for t in (q, k, v)))
        attn = attn[0].transpose(0, 1).reshape(n, -1)
        x, xn = norm_stage(x, sum_in_rank_order(engine.comm, F.linear(attn, lw.wo).float()), lw.post_norm, eps,
                           dtype)
        mlp = mlp_stage(xn, lw.w_gate, lw.w_up, lw.w_down) if lw.router is None else sparse_mlp(xn, lw, spec)
        delta = sum_in_rank_order(engine.comm, mlp.float())


class FirstChunkGraphs:
    """CUDA graphs of a prompt's first chunk, one per length bucket (powers of two from 16 to the chunk size),
    captured on first use: replayed, a chunk costs its kernels' GPU time alone. Launched one by one, the 256-token
    chunk of an 8B model took 25 ms of CPU time (H200 host) where its kernels needed 8. A shorter chunk runs
    in the next bucket up: its extra rows repeat the last token at the last position and store the last row's
    own K and V in the last row's slot, and the causal mask keeps them out of every real row's attention.
    Only where nothing in a layer waits for the host: one rank (the all-reduce is a host call), no sliding
    window (its mask is a tensor of the chunk's length), no sparse layer (its rows per expert are counted on
    the host)."""

    def __init__(self, engine, largest: int):
        self.engine = engine
        self.sizes = [16]
        while self.sizes[-1] < largest:
            self.sizes.append(self.sizes[-1] * 2)
        # tokens, positions, pages, slots and the stored row of the largest bucket; a bucket uses a prefix
        self.inputs = torch.zeros(5, self.sizes[-1], dtype=torch.int64, device=engine.kv.k.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None                  # one memory pool for every bucket's graph

    @staticmethod
    def applies(engine) -> bool:
        return (engine.device.type == "cuda" and engine.comm.world == 1 and not engine.spec.sliding_window
                and all(lw.router is None for lw in engine.weights.layers))

    def run(self, tokens: list[int], blocks: list[int]) -> None:
        size = self.stage(tokens, blocks)
        if size not in self.graphs:
            self.graphs[size] = self._capture(size)
        self.graphs[size].replay()

    def stage(self, tokens: list[int], blocks: list[int]) -> int:
        """Put the chunk in the inputs of its bucket (one host-to-device copy); the bucket's length."""
        n = len(tokens)
        size = next(s for s in self.sizes if s >= n)
        rows = np.minimum(np.arange(size), n - 1)
        bs = self.engine.kv.block_size
        staged = np.stack([np.asarray(tokens)[rows], rows, np.asarray(blocks)[rows // bs], rows % bs, rows])
        self.inputs[:, :size].copy_(torch.from_numpy(staged))
        return size

    def forward(self, size: int) -> None:
        """The staged chunk through every layer, as the bucket's graph records it."""
        ids, positions, page, slot, stored = self.inputs[:, :size]
        run_layers(self.engine, ids, positions, page, slot, own_keys, stored)

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        """Run the chunk once as it is (compiling what it needs; its writes are the chunk's own), then record it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(size)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.forward(size)
        return graph


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
