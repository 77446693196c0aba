"""What distmk's decode step is measured against: the HBM read bandwidth that bounds it (and the bytes a
step must read, which turn that bandwidth into a roofline), a per-op PyTorch decoder replayed as one CUDA
graph (optionally torch.compile'd), and transformers' own eager generate. What a prefill chunk is measured
against (benchmarks/prefill.py): its FLOP count, and a per-op PyTorch prefill of the same weights.

The PyTorch decoder reads the same RankWeights as distmk and splits work the same way under tensor
parallelism (NCCL all-reduce after o_proj and down_proj, all-gather of the vocab-parallel logits). A sparse
(mixture-of-experts) layer's MLP is its router, softmax and top-k, the chosen experts' products and the weighted
sum (sparse_mlp); the roofline of such a step counts the experts the step chose, not all of them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl

from distmk.models.fp8 import dequantize_blocks
from distmk.models.shard import RankWeights, ShardPlan, load_shard, plan_shard
from distmk.models.spec import ModelSpec
from distmk.runtime.prefill import linear as prefill_linear
from distmk.tasks.base import rope_angles as distmk_rope_angles
from distmk.tasks.moe_combine import weighted_sum
from distmk.tasks.route import choose
from distmk.timing import cuda_times, kernel_ms


def tp_rank() -> tuple[int, int]:
    """(world, rank) of the torch.distributed job, (1, 0) when none is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


# ----------------------------------------------------------------------------------------- roofline

@triton.jit
def _sum_chunks_kernel(x_ptr, out_ptr, chunk, BLOCK: tl.constexpr):
    """Program p sums x[p * chunk : (p + 1) * chunk] (chunk a multiple of BLOCK) into out[p]."""
    pid = tl.program_id(0)
    start = x_ptr + pid.to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(0, chunk, BLOCK):
        acc += tl.load(start + offset + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def measure_hbm_read_bandwidth(device="cuda", gib: float = 4) -> float:
    """Bytes/s a streaming read reaches on this GPU: the ceiling of a decode step, which reads every weight
    once. Best median over a small sweep of grid sizes (2..16 programs per SM) and block sizes; the buffer
    is far larger than L2, so nothing is served from cache. (H200: 4.57e12 to 4.68e12; torch's x.sum()
    about 4.25e12.)"""
    device = torch.device(device)
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    best = 0.0
    for block in (4096, 8192):
        for per_sm in (2, 4, 8, 16):
            programs = per_sm * sms
            chunk = x.numel() // programs // block * block
            out = torch.empty(programs, dtype=torch.float32, device=device)
            ms = kernel_ms(lambda: _sum_chunks_kernel[(programs,)](x, out, chunk, BLOCK=block, num_warps=8))
            best = max(best, programs * chunk * x.element_size() / (ms * 1e-3))
    return best


def decode_step_bytes(spec: ModelSpec, plan: ShardPlan, batch: int, context: int, dtype_bytes: int = 2,
                      experts_read: list[int] | None = None, e4m3=()) -> int:
    """HBM bytes one rank must read in a decode step of `batch` rows attending to `context` positions each:
    its weight shards (q/k/v with bias, o, gate, up, down, all norms, its lm_head rows including padding),
    the K and V it attends to, and the `batch` embedding rows it looks up (not the whole table).

    A sparse (mixture-of-experts) layer reads its router and, of its experts, only those the step chose: the
    union over the batch's rows, since rows that chose one expert can share one read of its weights (distmk's
    route task makes them). `experts_read` gives that number for each sparse layer, in spec.moe_layers' order
    (decode.py counts it from the step's own routing); without it, the most a step can choose,
    min(num_experts, batch * experts_per_token), in every sparse layer. The products named in `e4m3` (RankWeights.fp8:
    wqkv, wo, w_gate, w_up, w_down, the experts') are read as a byte a weight and a float32 scale a 128 x 128 block."""
    h, d = spec.hidden_size, spec.head_dim
    e4m3_ratio = (1 + 4 / 128 ** 2) / dtype_bytes        # of an e4m3 product's weight bytes to a dtype one's

    def product(name: str, count: int) -> float:
        return count * (e4m3_ratio if name in e4m3 else 1)

    qkv_rows = (plan.num_heads + 2 * plan.num_kv_heads) * d
    layer_weights = (product("wqkv", qkv_rows * h) + (qkv_rows if spec.qkv_bias else 0) + (2 * d if spec.qk_norm else 0)
                     + product("wo", h * plan.num_heads * d) + 2 * h)
    if experts_read is None:
        experts_read = [min(spec.num_experts, batch * spec.experts_per_token)] * len(spec.moe_layers)
    if len(experts_read) != len(spec.moe_layers) or not all(0 <= n <= spec.num_experts for n in experts_read):
        raise ValueError(f"experts_read must give 0..{spec.num_experts} experts for each of the "
                         f"{len(spec.moe_layers)} sparse layers, got {list(experts_read)}")
    mlp = (len(spec.dense_layers) * sum(product(name, plan.inter * h) for name in ("w_gate", "w_up", "w_down"))
           + sum(spec.num_experts * h + n * sum(product(name, plan.expert_inter * h)
                                                for name in ("expert_gate", "expert_up", "expert_down"))
                 for n in experts_read))
    keys = min(context, spec.sliding_window or context)
    layer_kv = 2 * plan.num_kv_heads * d * keys * batch
    return round((spec.num_layers * (layer_weights + layer_kv) + mlp + h + plan.vocab * h + batch * h) * dtype_bytes)


def distinct_experts(chosen: torch.Tensor) -> list[int]:
    """The number of distinct experts each sparse layer's rows chose, of chosen [sparse layers, rows, top_k]: the
    experts a step must read (decode_step_bytes' experts_read)."""
    return [len(set(layer.flatten().tolist())) for layer in chosen]


# ----------------------------------------------------------------------------- per-op PyTorch decoder

@dataclass
class TorchDecoder:
    """A built decoder: its capturable step and the static KV cache the step reads and writes."""
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (tokens[B], positions[B]) -> next tokens[B]
    k_cache: list[torch.Tensor]   # per layer [max_batch, local kv heads, max_context, head_dim]
    v_cache: list[torch.Tensor]
    # with record_experts: [sparse layers, max_batch, top_k] the experts each row chose in the last step
    experts: torch.Tensor | None = None


def prefill_chunk_flops(spec: ModelSpec, plan: ShardPlan, tokens: int, start: int = 0) -> int:
    """FLOPs of one rank's prefill chunk of `tokens` positions from `start` (runtime/prefill.py), 2 per
    multiply-add, over the chunk's rows: every layer's q/k/v products, and every layer's but the last
    attention (QK^T and PV over the keys each position sees: itself and those before it, within the sliding
    window), o, and the MLP: gate, up and down, or in a sparse layer the router and each row's top-k experts'
    gate, up and down. A chunk only writes the KV cache, so the last layer's rest and the lm_head feed nothing.
    What the products must do, not what a masked kernel spends on masked-out keys."""
    h, d = spec.hidden_size, spec.head_dim
    qkv_params = (plan.num_heads + 2 * plan.num_kv_heads) * d * h
    window = spec.sliding_window or start + tokens
    keys = sum(min(p + 1, window) for p in range(start, start + tokens))
    attention = 2 * 2 * plan.num_heads * d * keys
    rest = 0
    for layer in range(spec.num_layers - 1):
        mlp_params = (spec.num_experts * h + spec.experts_per_token * 3 * plan.expert_inter * h
                      if layer in spec.moe_layers else 3 * plan.inter * h)
        rest += 2 * (h * plan.num_heads * d + mlp_params) * tokens + attention
    return spec.num_layers * 2 * qkv_params * tokens + rest


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in float32, cast back, then scale."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, heads, D] with cos/sin [B, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, D] of the rotate-half RoPE at positions [B] (distmk's, tasks/base.py), in `dtype`."""
    cos, sin = distmk_rope_angles(positions, inv_freq)
    return cos.to(dtype), sin.to(dtype)


FP8_RECIPES = ("w8a16", "w8a8")


class E4M3(NamedTuple):
    """A product's e4m3 values and 128 x 128 block scales (RankWeights.fp8), as the FP8 decoder holds it; w8a8: its
    input is quantized too (linear)."""
    values: torch.Tensor
    scales: torch.Tensor
    w8a8: bool = False


def in_dtype(weight, dtype, index=None):
    """A weight (its matrices at `index`, where given: experts) in `dtype`; one in e4m3 (E4M3) dequantized within the
    step, torchao's float8 weight-only way, which torch.compile fuses into the product that reads it, so that the
    product reads the e4m3 bytes."""
    if not isinstance(weight, E4M3):
        return weight if index is None else weight[index]
    values, scales = (weight.values, weight.scales) if index is None else (weight.values[index], weight.scales[index])
    return dequantize_blocks(values, scales, dtype)


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of a weight in x's dtype or in e4m3: dequantized (in_dtype), or with E4M3.w8a8 both in e4m3, x
    quantized a row and 128 columns (torch._scaled_mm's blockwise kernel: the recipe vLLM runs block-FP8 checkpoints
    with, as distmk's prefill does)."""
    if isinstance(weight, E4M3) and weight.w8a8:
        out = prefill_linear(x, (weight.values, weight.scales))
        return out if bias is None else out + bias
    return F.linear(x, in_dtype(weight, x.dtype), bias)


def rotated_qkv(spec: ModelSpec, lw, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int):
    """A layer's q, k, v [B, heads, D] of the residual rows x [B, H]: input RMSNorm, the fused projection
    (+bias), q/k-norm where the model has it, RoPE of q and k."""
    d, eps, b = spec.head_dim, spec.rms_norm_eps, x.shape[0]
    qkv = linear(rms_norm(x, lw.input_norm, eps), lw.wqkv, lw.bqkv)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, hq, d), k.view(b, hkv, d), v.view(b, hkv, d)
    if spec.qk_norm:
        q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


SPARSE_PATHS = ("auto", "gather", "all")


def sparse_mlp(spec: ModelSpec, lw, h: torch.Tensor, rows: torch.Tensor, path: str = "auto"):
    """A sparse layer's MLP of the normed rows h [B, H], as capturable per-op PyTorch: (this rank's partial
    output [B, H] in h's dtype, the chosen experts [B, top_k]). The router's logits in float32, softmax and
    top-k as the route task has them (tasks/route.choose, renormalised where spec.norm_topk_prob says), the
    experts' products in h's dtype, and the routing-weighted sum in float32 in the order of the choices
    (tasks/moe_combine.weighted_sum). No host sync and no shape that depends on the routing: `rows` is
    arange(B) on the device. Two ways to run the experts, both of static shapes:

    gather: index the chosen experts' weights, w[experts] [B * top_k, I, H] (row b's k-th choice at
        b * top_k + k), and run them as batched matrix-vector products (torch.bmm), what gpt-fast does for
        Mixtral. Uncompiled, the index copies the weights before the products read them. Under torch.compile
        with coordinate-descent tuning (part of max-autotune) Inductor decomposes a bmm whose second operand
        has one column into a reduction, into which it can fuse the index, so that each slot's weights are read
        once, in place (expected from Inductor's decompositions; not yet seen on a GPU). Rows that chose the
        same expert read it once each.
    all: every expert over every row ([B, H] by [experts * I, H]), then each row's top_k outputs picked out:
        reads each expert once. Once B * top_k >= num_experts the gather reads at least as many bytes as this,
        so `auto` takes it then (mixtral-8x7b from batch 4, top 2 of 8) and the gather below (qwen3-30b-a3b to
        batch 15, top 8 of 128).
    A loop over the chosen experts alone would need the routing on the host (a sync a CUDA graph cannot hold);
    a loop over every expert with the unchosen rows masked reads every expert, which `all` does in one product.
    """
    b, top_k, num_experts = h.shape[0], spec.experts_per_token, spec.num_experts
    if path not in SPARSE_PATHS:
        raise ValueError(f"unknown sparse MLP path {path!r}: use one of {SPARSE_PATHS}")
    if path == "auto":
        path = "all" if b * top_k >= num_experts else "gather"
    weights, experts = choose(F.linear(h.float(), lw.router.float()), top_k, spec.norm_topk_prob)
    if path == "gather":
        slots = experts.reshape(b * top_k)
        x = h[:, None, :].expand(b, top_k, h.shape[1]).reshape(b * top_k, h.shape[1], 1)
        gate = torch.bmm(in_dtype(lw.expert_gate, h.dtype, slots), x)  # [B * top_k, I, 1]
        up = torch.bmm(in_dtype(lw.expert_up, h.dtype, slots), x)
        outs = torch.bmm(in_dtype(lw.expert_down, h.dtype, slots), F.silu(gate) * up).view(b, top_k, -1)
    else:
        expert_gate, expert_up, expert_down = (in_dtype(w, h.dtype) for w in (lw.expert_gate, lw.expert_up,
                                                                              lw.expert_down))
        inter = expert_gate.shape[1]
        gate = F.linear(h, expert_gate.reshape(num_experts * inter, -1)).view(b, num_experts, inter)
        up = F.linear(h, expert_up.reshape(num_experts * inter, -1)).view(b, num_experts, inter)
        every = torch.bmm((F.silu(gate) * up).transpose(0, 1), expert_down.transpose(1, 2))   # [E, B, H]
        outs = every[experts, rows[:, None]]                            # [B, top_k, H]
    return weighted_sum(weights, outs).to(h.dtype), experts


def e4m3_products(spec: ModelSpec, weights: RankWeights, layer: int, w8a8: bool = False) -> dict[str, E4M3]:
    """Layer `layer`'s products that `weights` hold in e4m3 (RankWeights.fp8: the experts' stacked over the sparse
    layers only); w8a8: the layer's own products multiply quantized inputs (the experts stay weight-only: one
    gathered expert a row)."""
    def index(name):
        """Where the layer's matrices sit in fp8[name] (None: the layer has none)."""
        if not name.startswith("expert"):
            return layer
        return spec.moe_layers.index(layer) if layer in spec.moe_layers else None

    return {name: E4M3(values[i], scales[i], w8a8 and not name.startswith("expert"))
            for name, (values, scales) in weights.fp8.items() if (i := index(name)) is not None}


def build_torch_decoder(spec: ModelSpec, weights: RankWeights, device, dtype, max_batch: int,
                        max_context: int, sparse: str = "auto", record_experts: bool = False,
                        fp8: str | None = None) -> TorchDecoder:
    """The decode step as plain per-op PyTorch kernels over one rank's shard, the way a well-written
    PyTorch server runs it (gpt-fast style): the baseline a CUDA graph or torch.compile can make of it.
    All state lives in static buffers, so `step` can be captured in a CUDA graph. The KV cache is one
    tensor per layer (not one [layers, ...] tensor) so that torch.compile sees no aliased inputs mutated.
    Sparse layers run sparse_mlp (`sparse`: its path); with record_experts the step also stores their
    choices in the decoder's `experts` (a copy per layer, so the timed steps leave it out). With fp8 (a recipe of
    FP8_RECIPES) the products that the weights hold in e4m3 (RankWeights.fp8) are multiplied from those bytes
    (linear)."""
    plan, d, eps = weights.plan, spec.head_dim, spec.rms_norm_eps
    if fp8:
        if fp8 not in FP8_RECIPES:
            raise ValueError(f"unknown FP8 recipe {fp8!r}: one of {', '.join(FP8_RECIPES)}")
        if not weights.fp8:
            raise ValueError("an FP8 decoder needs weights with e4m3 products (load_shard(keep_fp8=True) of an FP8 "
                             "checkpoint or --quantize fp8)")
        if weights.fp8_order is not None:
            raise ValueError("an FP8 decoder reads e4m3 products in their own column order: RankWeights.order_fp8(None)")
        layers = [replace(lw, **e4m3_products(spec, weights, i, fp8 == "w8a8")) for i, lw in enumerate(weights.layers)]
    else:       # products held in e4m3 alone dequantized: a bf16 copy of them while the decoder lives
        layers = [weights.layer(i) for i in range(spec.num_layers)]
    world, _ = tp_rank()
    hq, hkv = plan.num_heads, plan.num_kv_heads
    cache_shape = (max_batch, hkv, max_context, d)
    k_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    v_cache = [torch.zeros(cache_shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    all_rows = torch.arange(max_batch, device=device)
    key_positions = torch.arange(max_context, device=device)
    inv_freq = weights.inv_freq.to(device=device, dtype=torch.float32)
    experts = (torch.zeros(len(spec.moe_layers), max_batch, spec.experts_per_token, dtype=torch.int64, device=device)
               if record_experts else None)
    sparse_index = {layer: i for i, layer in enumerate(spec.moe_layers)}

    def all_reduce(x):
        if world > 1:
            dist.all_reduce(x)
        return x

    def step(tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        rows = all_rows[:b]
        cos, sin = rope_angles(positions, inv_freq, dtype)
        visible = key_positions <= positions[:, None]
        if spec.sliding_window:
            visible &= key_positions > positions[:, None] - spec.sliding_window
        mask = visible[:, None, None, :]                                   # [B, 1, 1, T]
        x = F.embedding(tokens, weights.embed)
        for layer, (lw, k_layer, v_layer) in enumerate(zip(layers, k_cache, v_cache)):
            q, k, v = rotated_qkv(spec, lw, x, cos, sin, hq, hkv)
            k_layer[rows, :, positions] = k
            v_layer[rows, :, positions] = v
            # GQA without copying the cache: the query heads sharing a KV head become its query rows.
            attn = F.scaled_dot_product_attention(q.view(b, hkv, hq // hkv, d), k_layer[:b], v_layer[:b],
                                                  attn_mask=mask)
            x = x + all_reduce(linear(attn.reshape(b, hq * d), lw.wo))
            h = rms_norm(x, lw.post_norm, eps)
            if lw.router is None:
                x = x + all_reduce(linear(F.silu(linear(h, lw.w_gate)) * linear(h, lw.w_up), lw.w_down))
            else:
                out, chosen = sparse_mlp(spec, lw, h, rows, sparse)
                if experts is not None:
                    experts[sparse_index[layer], :b] = chosen
                x = x + all_reduce(out)
        logits = F.linear(rms_norm(x, weights.final_norm, eps), weights.lm_head)   # [B, local vocab]
        if world > 1:
            shards = [torch.empty_like(logits) for _ in range(world)]
            dist.all_gather(shards, logits)
            logits = torch.cat(shards, dim=-1)
        return logits[:, :spec.vocab_size].argmax(dim=-1)

    return TorchDecoder(step, k_cache, v_cache, experts)


def random_state(spec: ModelSpec, batch: int, context: int):
    """A decoder's default state for a timed step (cudagraph_step_ms' `state`): a KV cache of random values and
    random tokens, `batch` rows at position context - 1."""
    def fill(decoder: TorchDecoder) -> tuple[torch.Tensor, torch.Tensor]:
        for cache in decoder.k_cache + decoder.v_cache:
            cache.normal_()
        device = decoder.k_cache[0].device
        return (torch.randint(spec.vocab_size, (batch,), device=device),
                torch.full((batch,), context - 1, device=device))
    return fill


def paged_state(k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: list[list[int]], tokens: list[int],
                positions: list[int]):
    """A decoder's state taken from distmk's (cudagraph_step_ms' `state`), so both run the same step: each row's
    cache positions copied from the paged KV pools [layers, blocks, block_size, kv heads, D] (runtime/kv_cache.py,
    row b's blocks block_tables[b]; as many positions as the decoder's cache holds), and the same tokens and
    positions. The sparse layers' routing then follows distmk's up to rounding."""
    def fill(decoder: TorchDecoder) -> tuple[torch.Tensor, torch.Tensor]:
        device = decoder.k_cache[0].device
        for layer, caches in enumerate(zip(decoder.k_cache, decoder.v_cache)):
            for pool, cache in zip((k_pool, v_pool), caches):
                for b, blocks in enumerate(block_tables):
                    seen = pool[layer, torch.as_tensor(blocks, device=pool.device)].flatten(0, 1)[:cache.shape[2]]
                    cache[b, :, :seen.shape[0]] = seen.transpose(0, 1).to(device=device, dtype=cache.dtype)
        return (torch.as_tensor(tokens, device=device), torch.as_tensor(positions, device=device))
    return fill


def routed_experts(spec: ModelSpec, weights: RankWeights, batch: int, context: int, device, dtype,
                   state=None) -> torch.Tensor:
    """[sparse layers, batch, top_k] the experts each row of one decode step chose in each sparse layer: one
    eager step of the PyTorch decoder (its router as the route task's) from `state` (random_state's by
    default; paged_state's for distmk's own step)."""
    decoder = build_torch_decoder(spec, weights, device, dtype, batch, max_context=-(-context // 16) * 16,
                                  record_experts=True)
    with torch.inference_mode():
        decoder.step(*(state or random_state(spec, batch, context))(decoder))
    return decoder.experts[:, :batch].cpu()


# torch.compile's arguments by decode.py's --compile-mode: max-autotune (the yardstick: Triton matmul templates
# tuned per shape, and coordinate-descent tuning, which also turns products of one row or one column into
# reductions that fuse their inputs: a gathered expert's weights are read in place); coordinate-descent alone
# (cuBLAS for the products of several rows: less to compile); default (no tuning at all)
COMPILE_MODES = {"max-autotune": {"mode": "max-autotune-no-cudagraphs"},
                 "coordinate-descent": {"options": {"coordinate_descent_tuning": True}},
                 "default": {}}


def cudagraph_step_ms(spec: ModelSpec, source, batch: int, context: int, dtype=torch.bfloat16,
                      compile: bool = False, iters: int = 200, weights: RankWeights | None = None, state=None,
                      compile_mode: str = "max-autotune", fp8: str | None = None) -> float:
    """Median ms of one decode step of the PyTorch decoder replayed as a single CUDA graph: `batch` rows at
    position `context - 1`, so each attends to `context` keys of a KV cache filled by `state` (random values by
    default: random_state; paged_state takes distmk's), each replay timed alone as harness.py times distmk's
    (distmk.timing.cuda_times). The graph removes launch overhead, which is what a megakernel must beat on top
    of it. With compile=True the step is first torch.compile'd (COMPILE_MODES[compile_mode], no CUDA graphs of
    its own), which fuses the small ops. `weights`: this rank's shard on the GPU to run (distmk's engine's, so
    that no second copy is loaded: mixtral-8x7b is 94 GB in bf16); else it is loaded from `source`. fp8 (a recipe
    of FP8_RECIPES): the products the weights hold in e4m3 are multiplied from them (build_torch_decoder).
    (H200, llama-3-8b, batch 1, context 1024, torch 2.11: 7.36 ms, compiled 5.13 ms; tp=2: 6.39, 4.55.)"""
    world, rank = tp_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    if weights is None:
        weights = load_shard(spec, source, plan_shard(spec, world, rank), dtype, device)
    decoder = build_torch_decoder(spec, weights, device, dtype, batch, max_context=-(-context // 16) * 16, fp8=fp8)
    tokens, positions = (state or random_state(spec, batch, context))(decoder)
    step = torch.compile(decoder.step, **COMPILE_MODES[compile_mode]) if compile else decoder.step
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                     # warm-up (and compilation) off the capture stream
            for _ in range(3):
                step(tokens, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(tokens, positions)
        return statistics.median(cuda_times(graph.replay, iters))


# ----------------------------------------------------------------------------- per-op PyTorch prefill

@dataclass
class TorchPrefill:
    """A built prefill: tokens[n] of a fresh sequence -> the final residual [n, H]; the KV cache it writes."""
    prefill: Callable[[torch.Tensor], torch.Tensor]
    k_cache: list[torch.Tensor]   # per layer [1, kv heads, max_context, head_dim]
    v_cache: list[torch.Tensor]


def build_torch_prefill(spec: ModelSpec, weights: RankWeights, max_context: int) -> TorchPrefill:
    """A prompt's first chunk as per-op PyTorch, the way a PyTorch server prefills (gpt-fast style): the
    decoder's products over all the chunk's rows at once, K and V stored in a contiguous cache per layer,
    causal scaled_dot_product_attention (flash attention on a GPU). Like distmk's prefill_chunk it stops at
    the last layer's K and V: nothing after them feeds the cache. One rank (the whole model). The cache is
    one tensor per layer so that torch.compile sees no aliased inputs mutated."""
    if weights.plan.tp != 1:
        raise ValueError(f"the PyTorch prefill baseline runs one rank, got a shard of tp={weights.plan.tp}")
    if spec.moe_layers:
        # a chunk's rows choose different experts: grouping them by expert takes shapes that depend on the
        # routing (a graph break per expert under torch.compile), and gathering each row's experts' weights, as
        # the decoder does, would copy n * top_k experts (qwen3-30b-a3b, 512 tokens: 38 GB)
        raise ValueError(f"the PyTorch prefill baseline has no mixture-of-experts layers ({spec.architecture}): "
                         f"run benchmarks/prefill.py with --baseline none")
    d, eps, hq, hkv = spec.head_dim, spec.rms_norm_eps, spec.num_heads, spec.num_kv_heads
    embed = weights.embed
    if spec.sliding_window and spec.sliding_window < max_context:
        raise ValueError(f"the PyTorch prefill baseline has no sliding window ({spec.sliding_window} < "
                         f"max_context {max_context})")
    cache_shape = (1, hkv, max_context, d)
    k_cache = [torch.zeros(cache_shape, dtype=embed.dtype, device=embed.device) for _ in range(spec.num_layers)]
    v_cache = [torch.zeros(cache_shape, dtype=embed.dtype, device=embed.device) for _ in range(spec.num_layers)]
    inv_freq = weights.inv_freq.to(device=embed.device, dtype=torch.float32)
    layers = [weights.layer(i) for i in range(spec.num_layers)]

    def prefill(tokens: torch.Tensor) -> None:
        n = tokens.shape[0]
        cos, sin = rope_angles(torch.arange(n, device=tokens.device), inv_freq, embed.dtype)
        x = F.embedding(tokens, embed)
        for layer, (lw, k_layer, v_layer) in enumerate(zip(layers, k_cache, v_cache)):
            q, k, v = rotated_qkv(spec, lw, x, cos, sin, hq, hkv)
            k_layer[0, :, :n] = k.transpose(0, 1)
            v_layer[0, :, :n] = v.transpose(0, 1)
            if layer == spec.num_layers - 1:
                return
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_layer[:, :, :n], v_layer[:, :, :n],
                                                  is_causal=True, enable_gqa=True)
            x = x + F.linear(attn[0].transpose(0, 1).reshape(n, hq * d), lw.wo)
            h = rms_norm(x, lw.post_norm, eps)
            x = x + F.linear(F.silu(F.linear(h, lw.w_gate)) * F.linear(h, lw.w_up), lw.w_down)

    return TorchPrefill(prefill, k_cache, v_cache)


# ----------------------------------------------------------------------------------- transformers

def hf_model(spec: ModelSpec, source, device, dtype):
    """transformers' own model class for the spec, holding the source's weights (copied one at a time)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = spec.to_hf_config()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=dtype)
    params = model.state_dict()
    assert set(params) - set(spec.tensor_shapes()) <= {"lm_head.weight"}, "transformers names other tensors"
    with torch.no_grad():
        for name in spec.tensor_shapes():
            params[name].copy_(source.read(name))
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def hf_eager_ms_per_token(spec: ModelSpec, source, batch: int, context: int, new_tokens: int = 32,
                          dtype=torch.bfloat16, device="cuda") -> float:
    """ms per decoded token of transformers' greedy `generate` (eager, its default attention and dynamic
    cache) after a random prompt of `context` tokens per row: what running the model in plain transformers
    gives. Prefill is removed by timing a 1-token generate as well. (H200, llama-3-8b, context 1024,
    transformers 5.17: 25 to 27 ms.)"""
    device = torch.device(device)
    model = hf_model(spec, source, device, dtype)
    prompt = torch.randint(spec.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)).to(device)

    def seconds(n):
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        sync()
        assert out.shape == (batch, context + n), out.shape
        return time.perf_counter() - start

    with torch.inference_mode():
        seconds(2)                                                      # warm-up
        # the fastest of five of each, interleaved: another process's load only adds time, and the median of five
        # paired differences still came out negative on a busy CPU (CI, a tiny model: ms against ms)
        runs = [(seconds(new_tokens), seconds(1)) for _ in range(5)]
        extra = min(n for n, _ in runs) - min(one for _, one in runs)
    return extra / (new_tokens - 1) * 1e3
