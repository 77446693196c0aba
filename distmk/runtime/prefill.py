"""Prompt prefill as matrix products: a chunk of one sequence's prompt runs through every layer as torch GEMMs
(cuBLAS on a GPU) with scaled_dot_product_attention over the paged KV cache, and writes that cache exactly where
the decode graph's tasks read it. The decode megakernel is a GEMV machine of at most a step's rows (16): a long
prompt through it is bound by the weight stream once per 16 tokens, where a GEMM reads the weights once a chunk.

On a GPU the element-wise work between the products (residual adds, RMSNorm, RoPE, SiLU) runs torch.compile'd,
one fused kernel per stage: op by op, a chunk is some 60 kernel launches a layer, which cost more than its products.

Numerics follow the graph's tasks (tasks/): the residual stream in float32, activations rounded to the model's
dtype where a task stores them, RMSNorm and RoPE in float32; the products run in the model's dtype (in bf16,
cuBLAS accumulates in float32 and rounds each output once, where the tasks keep float32 until they store).
Products an engine holds in e4m3 alone (kernel option stream_e4m3) multiply as the engine's prefill_fp8 says:
"w8a8", the chunk's activations quantized a row and 128 columns and multiplied in e4m3 by torch._scaled_mm (the
recipe of the block-FP8 checkpoints, as vLLM runs them; the default on Hopper), or "w8a16", the products
dequantized a layer at a time, as load_shard would have held them, for GEMMs in the model's dtype.
Under tensor parallelism every rank runs its shard and the row-parallel outputs are summed in rank order
(comm.gather), so the ranks stay bit-identical. A sparse layer routes and combines as router tiles do (a
batch-1 decode table whose o_proj tiles add the logits' shares routes on the float32 normed stream instead).
A chunk whose prompt's log-probabilities are asked for also runs the last layer to its end and the lm_head as a
GEMM over every rank's vocabulary slice; a chunk that ends its prompt does so for its last row, whose logits give
the sequence's first token (as vLLM's prefill does), rather than a decode step after it.

Even compiled, a chunk launched op by op is bound by the host (some 1300 kernel launches). So a chunk is replayed
as a CUDA graph where nothing in it waits for the host (ChunkGraphs), the first chunk of a prompt and the chunks
after it alike: a chunk after the first also stalls every running decode stream for its length. A chunk with
every row's logits runs op by op.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from distmk.comm import sum_in_rank_order
from distmk.kernels.chunk_attention import chunk_attention
from distmk.models.fp8 import KERNEL_BLOCK, dequantize_blocks, in_block_order, quantize_groups, scaled_mm_blocks
from distmk.tasks.base import rms_norm, rope_angles, rotate
from distmk.tasks.moe_combine import weighted_sum
from distmk.tasks.route import choose


PREFILL_FP8 = ("w8a8", "w8a16")      # how a chunk multiplies the products held in e4m3 (Engine's prefill_fp8)


def w8a8_input(x, w):
    """x quantized as product w multiplies it in e4m3 ((values, scales a row and 128 columns), the scales
    column-major as torch._scaled_mm takes them, written so by a compiled stage rather than copied after); None
    where w multiplies x as it is: a product in the model's dtype, or one whose K ends inside a block (the tl kernel
    may hold such a one in e4m3), dequantized."""
    if isinstance(w, torch.Tensor) or x.shape[-1] % KERNEL_BLOCK:
        return None
    values, scales = quantize_groups(x if len(w) == 2 else in_block_order(x, w[2]))
    return values, scales.t().contiguous().t()


def linear(x, w, xq=None):
    """x @ w.T for a product in the model's dtype, or for one held in e4m3, (values, block scales[, the order its
    values hold each 128 columns in]): x quantized a row and 128 columns (its columns taken in that order) and both
    multiplied in e4m3 (W8A8). xq: w8a8_input(x, w), where the caller has it."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w)
    xq = xq or w8a8_input(x, w)
    if xq is None:
        return F.linear(x, dequantize_blocks(w[0], w[1], x.dtype, *w[2:]))
    return scaled_mm_blocks(*xq, w[0], w[1], x.dtype)


def hidden(x, w_gate, w_up):
    """An MLP's (an expert's) hidden activations, silu(x @ w_gate.T) * (x @ w_up.T) in x's dtype: x quantized once
    for both products."""
    xq = w8a8_input(x, w_gate)
    return (F.silu(linear(x, w_gate, xq).float()) * linear(x, w_up, xq).float()).to(x.dtype)


def expert(w, index: int):
    """Expert `index`'s product of the experts' stacked one (a tensor, or e4m3 values and block scales)."""
    return w[index] if isinstance(w, torch.Tensor) else (w[0][index], w[1][index], *w[2:])


def held_e4m3(values, scales, dtype, order=None):
    """RankWeights.layer's convert for W8A8: a product held in e4m3 stays (values, block scales), with the order its
    values hold each 128 columns in where they have one (RankWeights.fp8_order)."""
    return (values, scales) if order is None else (values, scales, order)


def attention_inputs(x, delta, norm, wqkv, bqkv, q_norm, k_norm, cos, sin, heads: tuple[int, int, int],
                     eps: float, dtype):
    """The residual stream after the last layer's MLP (`delta`, None before the first layer) and this layer's
    rotated q, k and v in the model's dtype."""
    hq, hkv, d = heads
    if delta is not None:
        x = x + delta.float()
    qkv = linear(rms_norm(x, norm, eps).to(dtype), wqkv).float()
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
    return linear(hidden(xn, w_gate, w_up), w_down)


@functools.cache
def stages(compiled: bool):
    """The element-wise stages and the products between them, torch.compile'd (dynamic in the chunk's length: one
    compilation serves every chunk) or as they are."""
    funcs = attention_inputs, residual_norm, dense_mlp, dequantize_blocks, linear
    return tuple(torch.compile(f, dynamic=True) for f in funcs) if compiled else funcs


def prefill_chunk(engine, tokens: list[int], start: int, blocks: list[int], logits: bool = False,
                  last: bool = False):
    """Write the KV entries of `tokens`, at positions start..start + len(tokens) - 1 of the sequence whose KV
    blocks are `blocks` (positions before `start` are in the cache already). Every rank calls it together. With
    `logits`, also the [tokens, vocab] float32 logits of every position (the lm_head as a GEMM over every rank's
    vocabulary slice, gathered), what the prompt's log-probabilities are read from; else, with `last` (the chunk
    ends its prompt), the [1, vocab] logits of its last position, what the first token is chosen from; else
    None."""
    graphs = engine.prefill_graphs
    if graphs is not None and len(tokens) <= graphs.rows[-1] and not logits:
        return graphs.run(tokens, start, blocks, last)
    spec, kv, device = engine.spec, engine.kv, engine.kv.k.device
    n = len(tokens)
    positions = torch.arange(start, start + n, device=device)
    table = torch.as_tensor(blocks, dtype=torch.int64, device=device)
    page, slot = table[positions // kv.block_size], positions % kv.block_size
    if start == 0 and not spec.sliding_window:
        attend = own_keys
    else:
        attend = cached_keys(engine, table[:-(-(start + n) // kv.block_size)], positions)  # the blocks it may see
    out = slice(None) if logits else slice(n - 1, n) if last else None
    return run_layers(engine, torch.as_tensor(tokens, device=device), positions, page, slot, attend, out=out)


def visible(positions: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """[rows, keys] boolean mask: the key at position k is visible to the row at position p iff k <= p (and,
    with a sliding window, k > p - window)."""
    keep = keys[None, :] <= positions[:, None]
    return keep & (keys[None, :] > positions[:, None] - window) if window else keep


def cached_keys(engine, pages: torch.Tensor, positions: torch.Tensor):
    """attend(layer, q, k, v) of rows at `positions` (in order) over the keys of the cache's blocks `pages` (key j
    at position j), read after the layer's KV store (so the chunk's own keys are among them); a row sees the keys
    `visible` says. On a GPU, kernels/chunk_attention.py reads the keys from the blocks in place. Elsewhere blocks
    are gathered whole and a kv head's query heads folded into its rows ([1, kv heads, group x rows, D]) with the
    mask repeated for them, so that each kv head's keys are read once: with a mask, scaled_dot_product_attention's
    fused kernel (memory efficient) does not take GQA, and enable_gqa with a mask left it its math kernel alone,
    which materialises every score. Positions past the sequence's, in its last block or in blocks repeated after
    it, are never seen (the cache starts zeroed, so they are finite)."""
    kv, window = engine.kv, engine.spec.sliding_window
    if kv.k.is_cuda:
        def attend_in_place(layer, q, k, v):
            out = chunk_attention(q[0].transpose(0, 1), kv.k[layer], kv.v[layer], pages, positions,
                                  len(pages) * kv.block_size, window)
            return out.transpose(0, 1)[None]
        return attend_in_place
    group = engine.plan.num_heads // engine.plan.num_kv_heads
    seen = torch.arange(len(pages) * kv.block_size, device=positions.device)
    folded = visible(positions, seen, window).repeat(group, 1)

    def attend(layer, q, k, v):
        keys, values = (cache[layer][pages].flatten(0, 1).transpose(0, 1)[None] for cache in (kv.k, kv.v))
        _, heads, rows, d = q.shape
        out = F.scaled_dot_product_attention(q.reshape(1, heads // group, group * rows, d), keys, values,
                                             attn_mask=folded)
        return out.reshape(1, heads, rows, d)      # in float32 the kernel's output is not contiguous
    return attend


def own_keys(layer, q, k, v):
    """Attention of a first chunk, which sees its own keys alone: causal from the top left, the kv heads
    shared by their query heads inside the fused kernel ([1, heads, positions, D] each)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def run_layers(engine, ids, positions, page, slot, attend, stored=None, out=None):
    """The chunk's rows through every layer: tokens `ids` at `positions`, their K and V written to the cache's
    (page, slot); attend(layer, q, k, v) gives the attention of the rows' queries [1, heads, rows, D]. stored:
    the row whose K and V each cache write takes (default: its own). out: the rows (an index) whose [rows, vocab]
    float32 logits to return (the last layer then runs to its end); None: none."""
    spec, plan, weights, kv, dtype = engine.spec, engine.plan, engine.weights, engine.kv, engine.dtype
    n, heads, eps = ids.shape[0], (plan.num_heads, plan.num_kv_heads, spec.head_dim), spec.rms_norm_eps
    qkv_stage, norm_stage, mlp_stage, dequantize_stage, linear_stage = stages(engine.compile_prefill)
    e4m3 = held_e4m3 if engine.prefill_fp8 == "w8a8" else dequantize_stage
    cos, sin = rope_angles(positions, weights.inv_freq)
    x = weights.embed[ids].float()                                        # [n, H] residual stream
    delta = None                                                          # the last MLP's output, summed
    for layer in range(len(weights.layers)):
        lw = weights.layer(layer, e4m3)
        x, q, k, v = qkv_stage(x, delta, lw.input_norm, lw.wqkv, lw.bqkv, lw.q_norm, lw.k_norm, cos, sin, heads,
                               eps, dtype)
        kv.k[layer, page, slot] = k if stored is None else k[stored]
        kv.v[layer, page, slot] = v if stored is None else v[stored]
        if layer == len(weights.layers) - 1 and out is None:
            break                       # the chunk's output is its KV entries: the last layer's end feeds nothing
        attn = attend(layer, *(t.transpose(0, 1)[None] for t in (q, k, v)))
        attn = attn[0].transpose(0, 1).reshape(n, -1)
        x, xn = norm_stage(x, sum_in_rank_order(engine.comm, linear_stage(attn, lw.wo).float()), lw.post_norm, eps,
                           dtype)
        mlp = mlp_stage(xn, lw.w_gate, lw.w_up, lw.w_down) if lw.router is None else sparse_mlp(xn, lw, spec)
        delta = sum_in_rank_order(engine.comm, mlp.float())
    if out is not None:
        xn = rms_norm(x[out] + delta[out], weights.final_norm, eps).to(dtype)
        shards = engine.comm.gather(F.linear(xn, weights.lm_head).float())
        return torch.cat(shards, dim=-1)[:, :spec.vocab_size]
    return None


def powers_of_two(largest: int) -> list[int]:
    """16, 32, ... up to the first that is >= largest."""
    sizes = [16]
    while sizes[-1] < largest:
        sizes.append(sizes[-1] * 2)
    return sizes


class ChunkGraphs:
    """CUDA graphs of prefill chunks, one per bucket (rows, keys, last), captured on first use: replayed, a chunk
    costs its kernels' GPU time alone; one that ends its prompt (last) returns its last row's logits. Rows: powers
    of two from 16 to the chunk size. A shorter chunk runs in the next bucket up: its extra rows repeat the last
    token at the last position and store the last row's own K and V in the last row's slot, and the causal mask
    keeps them out of every real row's attention. Keys: 0 for a first chunk without a sliding window, which
    attends to its own keys alone (own_keys: causal flash or cuDNN attention, GQA inside the kernel); else every
    position a sequence's blocks hold, its blocks staged in order and its last again past them: the chunk's
    attention (cached_keys) reads the keys up to its rows' positions alone, so one bucket of keys serves every
    later chunk.

    Chunks of 512 make at most 6 first-chunk graphs and 6 later ones that end their prompt, and 2 of the chunk
    size that do not. They share one memory pool, and nothing a graph allocates outlives its replay but its logits
    (copied out), so the pool should hold about the largest graph's intermediates, not their sum.
    Only where nothing in a layer waits for the host: one rank (the all-reduce is a host call), no sparse layer
    (its rows per expert are counted on the host)."""

    def __init__(self, engine, largest: int):
        self.engine = engine
        self.held = engine.kv.blocks_per_seq * engine.kv.block_size   # the most positions a sequence's blocks hold
        self.rows = powers_of_two(largest)
        # a bucket's tokens, positions, pages, slots and stored row [5, rows], then its keys' blocks, one after
        # the other from the start
        self.inputs = torch.zeros(5 * self.rows[-1] + self.blocks(self.held), dtype=torch.int64,
                                  device=engine.kv.k.device)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.pool = None                  # one memory pool for every bucket's graph

    @staticmethod
    def applies(engine) -> bool:
        return (engine.device.type == "cuda" and engine.comm.world == 1
                and all(lw.router is None for lw in engine.weights.layers))

    def run(self, tokens: list[int], start: int, blocks: list[int], last: bool = False) -> torch.Tensor | None:
        """Replay the chunk's bucket; its last row's [1, vocab] logits where `last`, else None."""
        bucket = (*self.stage(tokens, start, blocks), last)
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return None if logits is None else logits.clone()

    def blocks(self, keys: int) -> int:
        """The KV blocks a bucket of `keys` keys gathers."""
        return -(-keys // self.engine.kv.block_size)

    def stage(self, tokens: list[int], start: int, blocks: list[int]) -> tuple[int, int]:
        """Put the chunk in the inputs of its bucket (one host-to-device copy); the bucket (rows, keys)."""
        n, bs = len(tokens), self.engine.kv.block_size
        size = next(s for s in self.rows if s >= n)
        own = start == 0 and not self.engine.spec.sliding_window
        keys = 0 if own else self.held
        rows = np.minimum(np.arange(size), n - 1)
        seen = np.minimum(np.arange(self.blocks(keys)), (start + n - 1) // bs)
        table, positions = np.asarray(blocks), start + rows
        staged = np.concatenate([np.asarray(tokens)[rows], positions, table[positions // bs], positions % bs, rows,
                                 table[seen]])
        self.inputs[:staged.size].copy_(torch.from_numpy(staged))
        return size, keys

    def forward(self, size: int, keys: int, last: bool) -> torch.Tensor | None:
        """The staged chunk through every layer, as the bucket's graph records it (its last row's logits where
        `last`: the staged rows past the chunk's repeat its last row, whose index ends `stored`)."""
        ids, positions, page, slot, stored = self.inputs[:5 * size].view(5, size)
        attend = own_keys
        if keys:
            attend = cached_keys(self.engine, self.inputs[5 * size:5 * size + self.blocks(keys)], positions)
        return run_layers(self.engine, ids, positions, page, slot, attend, stored, stored[-1:] if last else None)

    def _capture(self, bucket: tuple[int, int, bool]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        """Run the chunk once as it is (compiling what it needs; its writes are the chunk's own), then record it;
        the graph and the tensor its replays write the logits into (None: a chunk without them)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(*bucket)
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.forward(*bucket)
        return graph, logits


def sparse_mlp(xn: torch.Tensor, lw, spec) -> torch.Tensor:
    """A sparse layer's MLP output (this rank's partial sum, float32) for normed rows `xn`, as its tasks compute
    it with router tiles (GraphConfig.router_partials 2): the router's choices, each chosen expert's products
    over the rows that chose it, and the weighted sum in the order of the choices."""
    weights, experts = choose(xn.float() @ lw.router.float().t(), spec.experts_per_token, spec.norm_topk_prob)
    outs = torch.zeros(*experts.shape, spec.hidden_size, dtype=torch.float32, device=xn.device)
    for index in experts.unique().tolist():
        rows, choices = (experts == index).nonzero(as_tuple=True)
        h = hidden(xn[rows], expert(lw.expert_gate, index), expert(lw.expert_up, index))
        outs[rows, choices] = linear(h, expert(lw.expert_down, index)).float()
    return weighted_sum(weights, outs)
