"""The megakernels' interface, declared once: every argument a launch passes, what it is and who fills it.

Both megakernels' signatures are generated from these tuples (megakernel.py, ring_megakernel.py), the task
device functions are called by their parameters' names out of them, and the executor builds the launch
arguments with `launch_arguments`: the constants and scalars by the rules below, the tensors from their owners
(the stacked weights, the KV cache, the workspace, the executor's step inputs and symmetric memory), checked
name for name against BUFFERS. A task type that needs a new constant adds one line here, not a line in each of
the executor, the kernel signature and the dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton

from distmk.errors import DistmkError
from distmk.graph.lowering import hidden_tile_rows, qkv_tiles, router_shares
from distmk.graph.table import COLUMNS
from distmk.graph.workspace import WORKSPACE
from distmk.kernels.layout import STACKED
from distmk.tasks.attention import attention_heads


def padded(n: int, minimum: int = 16) -> int:
    """n rounded up to a power of two, at least `minimum`: the shapes tl blocks take."""
    return max(minimum, triton.next_power_of_2(n))


@dataclass(frozen=True)
class Launch:
    """What the rules of CONSTANTS and SCALARS read: the model, its shard, the table's config, the kernel
    options, and the executor's choices for this rank."""
    spec: object
    plan: object
    config: object          # GraphConfig
    options: object         # KernelOptions
    dtype: torch.dtype
    kv: object              # KVCache
    world: int
    rank: int
    interpret: bool
    transport: int          # index into executor.TRANSPORTS
    signal_add: int         # NVSHMEM's signal-add operation (-1: not the NVSHMEM transport)
    timeout: int            # us (polls when interpreted)
    lm_tiles: int
    exchange_slots: int
    peers_on_device: bool = False   # every rank runs on this GPU (virtual ranks: comm/cpu.py ThreadRanks)
    streams_e4m3: bool = False      # some products stream their e4m3 weights (RankWeights.fp8)

    @property
    def b_pad(self) -> int:
        return padded(self.config.batch)

    @property
    def block_n(self) -> int:
        """An o_proj tile's height where that is under 32 (hidden size 2048 over 132 workers: 16 rows), so a load
        step reads no padding rows (qwen3-30b-a3b's 16-row tiles would otherwise read as many again)."""
        return self.options.block_n or min(32, padded(hidden_tile_rows(self.spec, self.config)))

    @property
    def expert_block_k(self) -> int:
        """block_k for the expert down tiles' taller steps, halved while a step (the input's padded rows and
        expert_block_n weight rows) is over 40 KB: at 64 rows a step, batch 64 took 256 KB of shared memory."""
        k = self.block_k
        while k > 16 and (self.b_pad + self.options.expert_block_n) * k * self.dtype.itemsize > 40 * 1024:
            k //= 2
        return k

    @property
    def block_k(self) -> int:
        """16-32 KB of weights per load step in bf16; float32 (tests) halves K to stay in shared memory."""
        return self.options.block_k or (128 if self.dtype == torch.float32 else 256)


@dataclass(frozen=True)
class Arg:
    name: str
    rule: Callable[[Launch], object] | str   # a rule of the Launch, or who owns the tensor
    doc: str = ""


# The table and the step's state: the kernel's first parameters, filled by the executor.
CONTROL = ("tasks", "queue", "queue_ptr", "event_need", "epoch_ptr", "rows_ptr", "error", "trace")

# Launch scalars (not specialised on: one compiled kernel serves every rank and timeout). The timeout is in us so that
# it stays a 32-bit int: Triton types an int by its value, and a launch typed otherwise than the warm-up compiled
# loads another kernel, a load that waits for the kernels running (at tp > 1, peers that wait for this rank).
SCALARS = (
    Arg("rank", lambda l: l.rank, "this rank"),
    Arg("timeout", lambda l: l.timeout, "us a task may wait for its event"),
    Arg("vocab0", lambda l: l.plan.vocab0, "first vocabulary id of this rank's lm_head slice"),
    Arg("vocab_valid", lambda l: l.plan.vocab_valid, "ids of the slice that are real (the rest is padding)"),
)

# Values inside the kernel: a task's columns of its table row (graph/table.py), the step's rows, the worker.
# the kernels' variables of a row's COLUMNS, in order (`type` is a Python builtin: the task's kind)
ROW_VARIABLES = tuple("kind" if c == "type" else c for c in COLUMNS)
ROW = tuple(c for c in COLUMNS if c not in ("type", "wait"))
RUNTIME = (*ROW, "n", "worker", "rank", "vocab0", "vocab_valid")

# Tensors, passed by pointer; the rule names who owns each.
BUFFERS = (
    *(Arg(name, "weights", "stacked over layers (kernels/layout.py)") for name in STACKED),
    Arg("k_cache", "kv"), Arg("v_cache", "kv"),
    Arg("rope", "kv", "RoPE's cosines and sines of every position the cache holds (tasks/base.py rope_table)"),
    Arg("tokens", "step", "the step's inputs, rows 0..n-1"), Arg("positions", "step"), Arg("block_table", "step"),
    *(Arg(buffer.name, "workspace", buffer.doc) for buffer in WORKSPACE),
    # symmetric memory (tp > 1): this rank's event counters and exchange buffers, and the peers' addresses
    *(Arg(name, "symmetric") for name in ("counters", "counter_peers", "exchange", "exchange_peers", "best",
                                          "best_id", "best_peers", "best_id_peers")),
)

# Shapes and tile sizes: compile-time constants.
CONSTANTS = (
    Arg("H", lambda l: l.spec.hidden_size, "hidden size"),
    Arg("D", lambda l: l.spec.head_dim, "head size"),
    Arg("HQ", lambda l: l.plan.num_heads, "query heads of this rank"),
    Arg("HKV", lambda l: l.plan.num_kv_heads, "key/value heads of this rank"),
    Arg("G", lambda l: l.plan.group, "query heads per key/value head"),
    Arg("AH", lambda l: attention_heads(l.plan.group), "query heads of a group an attention task runs"),
    Arg("AH_PAD", lambda l: padded(attention_heads(l.plan.group))),
    Arg("INTER", lambda l: l.plan.inter, "MLP width of this rank"),
    Arg("EXPERTS", lambda l: l.spec.num_experts, "experts of a sparse layer (0: a dense model)"),
    Arg("EXPERTS_PAD", lambda l: padded(l.spec.num_experts), "experts padded (the route task holds all logits)"),
    Arg("TOP_K", lambda l: l.spec.experts_per_token, "experts each row chooses"),
    Arg("TOP_K_PAD", lambda l: padded(l.spec.experts_per_token, 2)),
    Arg("SLOTS_PAD", lambda l: padded(l.config.batch * l.spec.experts_per_token), "a step's choices, padded"),
    Arg("NORM_TOPK", lambda l: l.spec.norm_topk_prob, "the chosen experts' probabilities renormalised"),
    Arg("ROUTER_PARTS", lambda l: router_shares(l.spec, l.config),
        "o_proj tiles that add shares of the gate's logits (router_partials 1)"),
    Arg("O_PROJ_ROWS", lambda l: hidden_tile_rows(l.spec, l.config),
        "rows of a row-parallel tile over the hidden size, o_proj's and down's (row0 // O_PROJ_ROWS: an o_proj "
        "share's index)"),
    Arg("EXPERT_INTER", lambda l: l.plan.expert_inter, "an expert's MLP width on this rank"),
    Arg("BATCH", lambda l: l.config.batch, "rows a step holds at most"),
    Arg("VOCAB_L", lambda l: l.plan.vocab, "this rank's vocabulary slice, padded"),
    Arg("B_PAD", lambda l: l.b_pad, "the step's rows padded to a power of two, at least 16"),
    Arg("MAXB", lambda l: l.kv.blocks_per_seq, "KV blocks a sequence may hold"),
    Arg("BS", lambda l: l.kv.block_size, "positions per KV block"),
    Arg("NBLK", lambda l: l.kv.num_blocks, "KV blocks per layer"),
    Arg("S", lambda l: l.config.kv_splits, "attention splits of the keys"),
    Arg("EPS", lambda l: l.spec.rms_norm_eps),
    Arg("HAS_BIAS", lambda l: l.spec.qkv_bias),
    Arg("QK_NORM", lambda l: l.spec.qk_norm, "Qwen3's per-head q/k RMSNorm"),
    Arg("WINDOW", lambda l: l.spec.sliding_window or 0, "sliding-window width (0: none)"),
    Arg("SCALE", lambda l: l.spec.head_dim ** -0.5, "attention's softmax scale"),
    Arg("LM_TILES", lambda l: l.lm_tiles, "lm_head tiles (argmax reads their maxima)"),
    Arg("LM_TILES_PAD", lambda l: padded(l.lm_tiles, 2)),
    Arg("BLOCK_H", lambda l: min(1024, padded(l.spec.hidden_size)), "columns of an elementwise block"),
    Arg("BLOCK_T", lambda l: 32, "keys of an attention block"),
    Arg("DOT_PRECISION", lambda l: "ieee" if l.dtype == torch.float32 else "tf32"),
    Arg("PREFETCH", lambda l: 0 if l.interpret else l.options.prefetch_kb * 1024, "bytes of L2 prefetch a task"),
    Arg("NORM_BLOCK", lambda l: padded(l.spec.hidden_size), "columns of an RMSNorm's load: a whole row"),
    Arg("WORLD", lambda l: l.world, "tensor-parallel ranks"),
    # exchanges: 0 = stores through peer pointers, 1 = NVSHMEM put-with-signal (device/exchange.py)
    Arg("TRANSPORT", lambda l: l.transport),
    Arg("SIGNAL_ADD", lambda l: l.signal_add),
    Arg("SYSTEM_SCOPE", lambda l: l.world > 1 and not l.peers_on_device,
        "peers on other GPUs signal events: acquire and release at system scope (the ring kernel; GPU scope where "
        "every rank shares this GPU)"),
    Arg("EXCHANGE_SLOTS", lambda l: l.exchange_slots, "row-parallel outputs whose exchanges may be in flight"),
    # matmul tiles per task family: (rows, K) of one pipelined load step; gate+up and the two halves of a head
    # load two tiles a step, so their K is halved
    Arg("BLOCK_N", lambda l: l.block_n),
    Arg("BLOCK_K", lambda l: l.block_k),
    Arg("EXPERT_BLOCK_N", lambda l: l.options.expert_block_n),
    Arg("EXPERT_BLOCK_K", lambda l: l.expert_block_k),
    Arg("MLP_BLOCK_N", lambda l: l.options.mlp_block_n),
    Arg("MLP_BLOCK_K", lambda l: l.block_k // 2),
    Arg("LM_BLOCK_N", lambda l: l.options.lm_block_n),
    Arg("LM_BLOCK_K", lambda l: l.block_k // 2),
    Arg("QKV_BLOCK_N", lambda l: min(32, padded(qkv_tiles(l.spec, l.plan, l.config)[0][1]))),   # the first: tallest
    # the weight ring (ring megakernel): device/ring.py's _claim_slot
    Arg("RING_INFLIGHT", lambda l: l.options.ring_inflight, "weight slots in flight while the ring fills (0: all)"),
    Arg("FUSED_ATTN_REDUCE", lambda l: l.config.fused_attn_reduce, "the last split of a group combines it"),
    Arg("FUSED_ROUTE", lambda l: l.config.fused_route, "the o_proj tile that adds a layer's last share routes it"),
    # MoE kernels are larger, and 2 keys a pass is less code; a kernel streaming e4m3 weights spills registers in its
    # attention tasks at 4; dense bf16 kernels gain nothing from it
    Arg("RING_ATTN_KEYS", lambda l: l.options.ring_attention_keys or (2 if l.spec.num_experts or l.streams_e4m3 else 0),
        "keys a thread of an attention task holds a pass (0: by its heads)"),
)

# Flags of the kernel itself, after the constants.
FLAGS = (
    Arg("TRACE", lambda l: l.options.trace, "record every task's wait, start, end and SM"),
    Arg("INTERPRET", lambda l: l.interpret, "under Triton's interpreter (the tl kernel only)"),
)

NAMES = {"buffers": tuple(a.name for a in BUFFERS), "constants": tuple(a.name for a in CONSTANTS)}


def launch_arguments(launch: Launch, control: dict, tensors: dict) -> dict:
    """Every argument of the tl megakernel, by name: `control` (CONTROL), `tensors` (exactly BUFFERS'), the
    scalars, constants and flags by their rules."""
    for what, given, declared in (("control", control, CONTROL), ("tensors", tensors, NAMES["buffers"])):
        missing, extra = sorted(set(declared) - set(given)), sorted(set(given) - set(declared))
        if missing or extra:
            raise DistmkError(f"megakernel {what}: missing {missing}, not declared {extra} (kernels/interface.py)")
    return {**control, **{a.name: a.rule(launch) for a in SCALARS}, **tensors,
            **{a.name: a.rule(launch) for a in CONSTANTS + FLAGS}}
