"""Tensor-parallel sharding: which slice of every tensor a rank owns, and reading just those slices.

q/k/v and gate/up are column-parallel (heads and intermediate rows split), o_proj and down_proj are
row-parallel (their outputs are partial sums, all-reduced), lm_head is vocab-parallel (padded so each
rank holds the same number of rows). With fewer KV heads than ranks each rank keeps the one KV head its
query heads use (replication). The embedding table is replicated: a step reads only B rows of it.

Experts are split as the dense MLP is, along their intermediate dimension: every rank holds the same rows
of every expert's gate/up and columns of its down, so a sparse layer's output is a row-parallel partial
sum like a dense one's and the same all-reduce tiles combine it. The router is replicated: every rank
routes every token itself, to the same experts (its input, the residual stream, is bit-identical).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from tqdm import tqdm

from distmk.errors import ShardingError
from distmk.models.fp8 import KERNEL_BLOCK, dequantize_blocks, in_block_order
from distmk.models.spec import ModelSpec


@dataclass(frozen=True)
class ShardPlan:
    tp: int
    rank: int
    num_heads: int      # local query heads
    head0: int          # first global query head
    num_kv_heads: int   # local KV heads
    kv_head0: int
    inter: int          # local intermediate rows
    inter0: int
    vocab: int          # local lm_head rows (padded: equal on every rank)
    vocab0: int         # global id of local row 0
    vocab_valid: int    # rows that are real vocabulary entries (the rest are zero padding)
    expert_inter: int = 0   # local intermediate rows of each expert
    expert_inter0: int = 0

    @property
    def group(self) -> int:
        """Query heads per local KV head."""
        return self.num_heads // self.num_kv_heads


def plan_shard(spec: ModelSpec, tp: int, rank: int) -> ShardPlan:
    if tp < 1 or not 0 <= rank < tp:
        raise ShardingError(f"rank {rank} is not in 0..{tp - 1} (tp={tp})")
    if spec.num_heads % tp:
        raise ShardingError(f"tp={tp} does not divide num_attention_heads={spec.num_heads}; "
                            f"use a tp that divides it ({_divisors(spec.num_heads)})")
    if spec.intermediate_size % tp:
        raise ShardingError(f"tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.moe_intermediate_size % tp:
        raise ShardingError(f"tp={tp} does not divide the experts' intermediate size {spec.moe_intermediate_size}")
    hq = spec.num_heads // tp
    group = spec.num_heads // spec.num_kv_heads
    if spec.num_kv_heads >= tp:
        if spec.num_kv_heads % tp:
            raise ShardingError(f"tp={tp} does not divide num_key_value_heads={spec.num_kv_heads}")
        hkv, kv0 = spec.num_kv_heads // tp, rank * spec.num_kv_heads // tp
    else:
        if tp % spec.num_kv_heads:
            raise ShardingError(f"tp={tp} is not a multiple of num_key_value_heads={spec.num_kv_heads}, "
                                f"so KV heads cannot be replicated evenly")
        hkv, kv0 = 1, rank * hq // group
    inter = spec.intermediate_size // tp
    vocab = -(-spec.vocab_size // tp)
    vocab0 = rank * vocab
    expert_inter = spec.moe_intermediate_size // tp
    return ShardPlan(tp, rank, hq, rank * hq, hkv, kv0, inter, rank * inter, vocab, vocab0,
                     max(0, min(vocab, spec.vocab_size - vocab0)), expert_inter, rank * expert_inter)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in (1, 2, 4, 8, 16) if n % d == 0)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor      # [H]
    wqkv: torch.Tensor            # [(hq + 2*hkv) * D, H]: local q heads, then k heads, then v heads
    bqkv: torch.Tensor | None     # [(hq + 2*hkv) * D]
    q_norm: torch.Tensor | None   # [D]
    k_norm: torch.Tensor | None   # [D]
    wo: torch.Tensor              # [H, hq * D]
    post_norm: torch.Tensor       # [H]
    w_gate: torch.Tensor | None   # [I_local, H] (a dense MLP; None in a sparse layer)
    w_up: torch.Tensor | None     # [I_local, H]
    w_down: torch.Tensor | None   # [H, I_local]
    router: torch.Tensor | None = None       # [experts, H] replicated (a sparse layer; None in a dense one)
    expert_gate: torch.Tensor | None = None  # [experts, I_expert_local, H]
    expert_up: torch.Tensor | None = None    # [experts, I_expert_local, H]
    expert_down: torch.Tensor | None = None  # [experts, H, I_expert_local]


@dataclass
class RankWeights:
    plan: ShardPlan
    embed: torch.Tensor           # [V, H] replicated
    layers: list[LayerWeights]
    final_norm: torch.Tensor      # [H]
    lm_head: torch.Tensor         # [V_local, H], zero rows past vocab_valid
    inv_freq: torch.Tensor = field(default=None)  # [D/2] float32
    stacked: dict | None = None   # per-kind tensors stacked over layers for the megakernel (kernels/layout.py)
    # the products' e4m3 values [layers, rows, K] and 128 x 128 block scales [layers, rows / 128, K / 128] by name
    # (the experts': [sparse layers, experts, ...]), where the source has them and this rank's slices hold whole
    # blocks: what the megakernels stream with kernel option stream_e4m3. These products are held so alone:
    # their LayerWeights fields are None (layer() dequantizes them)
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # where set, the fp8 values hold each 128 columns in this order, on their device (order_fp8): a block's column p
    # is its column fp8_order[p]
    fp8_order: torch.Tensor | None = None

    def layer(self, i: int, convert=dequantize_blocks) -> LayerWeights:
        """Layer i's weights with every product in the model's dtype: those held in e4m3 alone dequantized now, by
        convert(values, scales, dtype, fp8_order), for what multiplies bf16 weights (prefill's GEMMs, the PyTorch
        baselines, a float32 reference); prefill passes its compiled dequantize_blocks, or, multiplying in e4m3, a
        convert that keeps (values, scales[, order])."""
        lw = self.layers[i]
        if not self.fp8:
            return lw
        dtype = self.embed.dtype
        sparse = sum(w.router is not None for w in self.layers[:i])      # i's index among the sparse layers
        held = {}
        for name, (values, scales) in self.fp8.items():
            if not name.startswith("expert"):
                held[name] = convert(values[i], scales[i], dtype, self.fp8_order)
            elif lw.router is not None:
                held[name] = convert(values[sparse], scales[sparse], dtype, self.fp8_order)
        return replace(lw, **held) if held else lw

    def order_fp8(self, order: list[int] | None) -> None:
        """Hold the e4m3 values' columns in `order` within each 128 (None: their own), in place, a matrix at a time
        (the weight ring's order: device/ring.py part_columns)."""
        current = None if self.fp8_order is None else self.fp8_order.tolist()
        if not self.fp8 or order == current:
            return
        device = next(iter(self.fp8.values()))[0].device
        new = None if order is None else torch.tensor(order, device=device)
        own = torch.arange(KERNEL_BLOCK, device=device)
        # a block's column p comes to hold column new[p], which is now at column argsort(current)[new[p]]
        take = torch.argsort(own if self.fp8_order is None else self.fp8_order)[own if new is None else new]
        for values, _ in self.fp8.values():
            for matrices in values.view(torch.uint8).flatten(0, -3):
                matrices.copy_(in_block_order(matrices, take))
        self.fp8_order = new


def load_shard(spec: ModelSpec, source, plan: ShardPlan, dtype=torch.float32, device="cpu",
               progress: bool = False, keep_fp8: bool = False) -> RankWeights:
    """Read this rank's slices from `source` (CheckpointWeights, RandomWeights or models/fp8.py QuantizedAtLoad);
    with `keep_fp8`, the products' e4m3 values and scales where the source has them (RankWeights.fp8), in place of
    their values in `dtype`: an FP8 model is held in half the bytes."""
    d = spec.head_dim

    def rd(name, dim=0, start=0, stop=None):
        return source.read(name, dim, start, stop).to(device=device, dtype=dtype)

    def rd8(*pieces):
        """(values, scales) of the (name, dim, start, stop) pieces, concatenated over rows; None unless every piece
        is stored in e4m3 kernel blocks, and all but the last hold whole blocks of rows (so that the scales of row r
        stay row r // 128 of the concatenated grid)."""
        got = [source.read_fp8(*piece) for piece in pieces] if hasattr(source, "read_fp8") else [None]
        if any(g is None for g in got) or any(len(values) % KERNEL_BLOCK for values, _ in got[:-1]):
            return None
        return tuple(torch.cat([g[i] for g in got]).to(device) for i in (0, 1))

    q_rows = (plan.head0 * d, (plan.head0 + plan.num_heads) * d)
    kv_rows = (plan.kv_head0 * d, (plan.kv_head0 + plan.num_kv_heads) * d)
    inter = (plan.inter0, plan.inter0 + plan.inter)
    expert_inter = (plan.expert_inter0, plan.expert_inter0 + plan.expert_inter)

    def product(name: str, read):
        """Product `name` of a layer in the model's dtype, read(); None where its e4m3 values are kept (RankWeights.fp8
        holds it)."""
        return None if name in fp8 else read()

    def stacked(stacks: dict, key, count: int, index: int, t: torch.Tensor) -> torch.Tensor:
        """t copied into stacks[key][index], the [count, ...] tensor of its kind allocated at its first layer: the
        layers' tensors held once, laid out as the megakernel takes them (kernels/layout.py), never twice."""
        if key not in stacks:
            stacks[key] = t.new_empty((count, *t.shape))
        stacks[key][index].copy_(t)
        return stacks[key][index]

    expert_stacks = {}      # name -> [sparse layers, experts, rows, K]

    def experts(name: str, i: int, pieces: list) -> torch.Tensor:
        """Layer i's experts' slices of `name` ([experts, rows, K]), by product(), as a view of the one tensor that
        holds them for every sparse layer (the experts are most of a MoE model)."""
        layer = product(name, lambda: torch.stack([rd(*piece) for piece in pieces]))
        if layer is None:
            return None
        return stacked(expert_stacks, name, len(spec.moe_layers), spec.moe_layers.index(i), layer)

    def mlp(i: int) -> dict:
        """Layer i's MLP weights: this rank's rows of the dense MLP, or the router and every expert's rows."""
        p = f"model.layers.{i}."
        if i not in spec.moe_layers:
            return dict(w_gate=product("w_gate", lambda: rd(p + "mlp.gate_proj.weight", 0, *inter)),
                        w_up=product("w_up", lambda: rd(p + "mlp.up_proj.weight", 0, *inter)),
                        w_down=product("w_down", lambda: rd(p + "mlp.down_proj.weight", 1, *inter)))
        names = [spec.moe_names(i, j) for j in range(spec.num_experts)]
        return dict(w_gate=None, w_up=None, w_down=None, router=rd(names[0][0]),
                    expert_gate=experts("expert_gate", i, [(gate, 0, *expert_inter) for _, gate, _, _ in names]),
                    expert_up=experts("expert_up", i, [(up, 0, *expert_inter) for _, _, up, _ in names]),
                    expert_down=experts("expert_down", i, [(down, 1, *expert_inter) for *_, down in names]))

    def products_fp8(i: int) -> dict:
        """Layer i's products in e4m3 (those stored so), by RankWeights.fp8's names."""
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        pieces = {"wqkv": [(a + "q_proj.weight", 0, *q_rows), (a + "k_proj.weight", 0, *kv_rows),
                           (a + "v_proj.weight", 0, *kv_rows)],
                  "wo": [(a + "o_proj.weight", 1, *q_rows)]}
        if i not in spec.moe_layers:
            pieces.update(w_gate=[(p + "mlp.gate_proj.weight", 0, *inter)],
                          w_up=[(p + "mlp.up_proj.weight", 0, *inter)],
                          w_down=[(p + "mlp.down_proj.weight", 1, *inter)])
        got = {name: rd8(*piece) for name, piece in pieces.items()}
        if i in spec.moe_layers:       # every expert's, stacked [experts, ...]
            names = [spec.moe_names(i, j) for j in range(spec.num_experts)]
            for name, k, dim in (("expert_gate", 1, 0), ("expert_up", 2, 0), ("expert_down", 3, 1)):
                each = [rd8((moe[k], dim, *expert_inter)) for moe in names]
                got[name] = None if None in each else tuple(torch.stack([e[j] for e in each]) for j in (0, 1))
        return got

    fp8 = {}
    if keep_fp8:
        # the dense MLP where every layer has it; the experts over the sparse layers ([sparse layers, experts, ...])
        names = ("wqkv", "wo", "w_gate", "w_up", "w_down") if not spec.moe_layers else ("wqkv", "wo")
        layers_of = {name: range(spec.num_layers) for name in names}
        if spec.moe_layers:
            layers_of.update(dict.fromkeys(("expert_gate", "expert_up", "expert_down"), spec.moe_layers))
        stacks, missing = {}, set()         # a product that some layer lacks in e4m3 is read in `dtype` instead
        for i in range(spec.num_layers):
            for name, got in products_fp8(i).items():
                if name not in layers_of or name in missing:
                    continue
                if got is None:
                    missing.add(name)
                    continue
                for part, t in enumerate(got):
                    stacked(stacks, (name, part), len(layers_of[name]), layers_of[name].index(i), t)
        fp8 = {name: (stacks[name, 0], stacks[name, 1]) for name in layers_of
               if name not in missing and (name, 0) in stacks}
        del stacks
    layers = []
    for i in tqdm(range(spec.num_layers), desc="loading layers", disable=not progress, leave=False):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        wqkv = product("wqkv", lambda: torch.cat([rd(a + "q_proj.weight", 0, *q_rows),
                                                  rd(a + "k_proj.weight", 0, *kv_rows),
                                                  rd(a + "v_proj.weight", 0, *kv_rows)]))
        bqkv = torch.cat([rd(a + "q_proj.bias", 0, *q_rows), rd(a + "k_proj.bias", 0, *kv_rows),
                          rd(a + "v_proj.bias", 0, *kv_rows)]) if spec.qkv_bias else None
        layers.append(LayerWeights(
            input_norm=rd(p + "input_layernorm.weight"),
            wqkv=wqkv, bqkv=bqkv,
            q_norm=rd(a + "q_norm.weight") if spec.qk_norm else None,
            k_norm=rd(a + "k_norm.weight") if spec.qk_norm else None,
            wo=product("wo", lambda: rd(a + "o_proj.weight", 1, *q_rows)),
            post_norm=rd(p + "post_attention_layernorm.weight"),
            **mlp(i),
        ))
    head_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    lm_head = torch.zeros(plan.vocab, spec.hidden_size, dtype=dtype, device=device)
    if plan.vocab_valid:
        lm_head[:plan.vocab_valid] = rd(head_name, 0, plan.vocab0, plan.vocab0 + plan.vocab_valid)
    return RankWeights(plan=plan, embed=rd("model.embed_tokens.weight"), layers=layers,
                       final_norm=rd("model.norm.weight"), lm_head=lm_head,
                       inv_freq=spec.inv_freq().to(device), fp8=fp8)
