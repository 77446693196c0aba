"""Engine: one rank's model shard, its compiled step, its KV cache, and the generation loop on top.

A step is a batch of rows, each a token at a position of some sequence, so a short prompt chunk is just
several rows of one sequence (row b attends to the keys rows < b of the same step wrote); a long prompt is
prefilled in chunks of `prefill_chunk` tokens by matrix products (runtime/prefill.py). Every rank runs the
same loop; greedy tokens come from the in-graph distributed argmax, sampled ones from logits gathered across
ranks. Besides the table of a full step, the engine may hold tables lowered for fewer rows (step_batches);
each step runs the smallest one that holds its rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from distmk.errors import DistmkError
from distmk.graph.hardware import hbm_bytes_per_s, sm_workers
from distmk.graph.lowering import GraphConfig, compile_step
from distmk.models.shard import load_shard, plan_shard
from distmk.models.fp8 import QuantizedAtLoad
from distmk.models.weights import open_model
from distmk.comm.cpu import SingleRank
from distmk.reference.executor import ReferenceExecutor
from distmk.runtime.batcher import Batcher, Sequence
from distmk.runtime.kv_cache import KVCache
from distmk.runtime.prefill import PREFILL_FP8, ChunkGraphs
from distmk.runtime.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_fields(backend: str, device, workers: int | None = None, ranks_on_device: int = 1) -> dict:
    """The GraphConfig fields the device decides: the worker count (`workers` if given, else one per SM on
    a GPU, shared out among the `ranks_on_device` ranks that run on it at once (virtual ranks), one under Triton's
    sequential interpreter, else graph.hardware's default) and the HBM bandwidth of the cost model."""
    on_gpu = torch.device(device).type == "cuda"
    if workers is None:
        workers = 1 if backend == "triton" and not on_gpu else sm_workers(device) // (ranks_on_device if on_gpu else 1)
    return {"workers": workers, "hbm_bytes_per_s": hbm_bytes_per_s(device)}


def reference_executor(engine, table, options: dict, autotune: bool, progress: bool):
    """The CPU reference executor: kernel options and autotuning do not apply to it."""
    return ReferenceExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype)


def triton_executor(engine, table, options: dict, autotune: bool, progress: bool):
    """The megakernel executor with tuned options: explicit options win, then the on-disk choice for this GPU
    and shape, then (autotune, on a GPU) a fresh measurement, else the defaults."""
    from distmk.kernels import autotune as tuning
    from distmk.kernels.executor import TritonExecutor

    def make(extra):
        return TritonExecutor(table, engine.spec, engine.weights, engine.kv, engine.comm, engine.dtype,
                              **{**extra, **options})

    key = tuning.tuning_key(engine.spec, engine.plan, table, engine.dtype, engine.device)
    tuned = tuning.cached_options(key)
    # tensor-parallel ranks take the cached or default options: tuning them would need a common choice
    if tuned is None and autotune and engine.device.type == "cuda" and engine.comm.world == 1:
        log = print if progress else None
        tuned = tuning.tune(key, make, table.config.batch, min(511, engine.max_context - 1), log)
    return make(tuned or {})


def pack_rows(tokens, positions, block_tables, width: int) -> np.ndarray:
    """A step's rows as one int64 [rows, 2 + width] array: token, position, then the block table padded with
    zeros. Built in numpy, in one piece: a tensor a row costs the host a few times more."""
    rows = np.zeros((len(tokens), 2 + width), dtype=np.int64)
    rows[:, 0], rows[:, 1] = tokens, positions
    for i, blocks in enumerate(block_tables):
        rows[i, 2:2 + len(blocks)] = blocks
    return rows


# how each backend builds the executor of one step table: (engine, table, kernel options, autotune, progress)
BACKENDS = {"reference": reference_executor, "triton": triton_executor}


class Engine:
    def __init__(self, model: str, *, tp: int = 1, rank: int = 0, comm=None, dtype=torch.float32,
                 device="cpu", backend: str = "reference", config: GraphConfig | None = None,
                 max_context: int | None = None, block_size: int = 16, seed: int = 0, progress: bool = False,
                 kernel_options: dict | None = None, autotune: bool = True, max_seqs: int | None = None,
                 prefill_chunk: int = 0, step_batches: tuple[int, ...] = (), compile_prefill: bool | None = None,
                 prefill_graphs: bool = True, quantize: str | None = None, prefill_fp8: str | None = None):
        if backend not in BACKENDS:
            raise DistmkError(f"unknown backend {backend!r}: use {' or '.join(BACKENDS)}")
        self.comm = comm or SingleRank()
        if self.comm.world != tp:
            raise DistmkError(f"tp={tp} but the communicator has {self.comm.world} ranks")
        self.spec, source, self.tokenizer_dir = open_model(model, seed=seed, device=device)
        if quantize not in (None, "fp8"):
            raise DistmkError(f"unknown quantization {quantize!r}: the one there is is fp8")
        if quantize:            # its FP8 twin: the products' weights in 128 x 128 blocks (models/fp8.py)
            source = QuantizedAtLoad(source, self.spec)
        max_context = min(2048, self.spec.max_position_embeddings) if max_context is None else max_context
        if max_context < 1:
            raise DistmkError(f"max_context must be >= 1, got {max_context}")
        if max_context > self.spec.max_position_embeddings:
            raise DistmkError(f"max_context {max_context} exceeds the model's max_position_embeddings "
                              f"{self.spec.max_position_embeddings}")
        if prefill_chunk < 0:
            raise DistmkError(f"prefill_chunk must be >= 0 (0: prompts go through the decode steps), got "
                              f"{prefill_chunk}")
        # prompt tokens per prefill chunk (runtime/prefill.py); 0 here, 512 from the CLIs (--prefill-chunk); its
        # element-wise stages torch.compile'd (default: on a GPU), every chunk replayed as a CUDA graph of its
        # length where it can be (prefill_graphs, runtime/prefill.ChunkGraphs)
        self.prefill_chunk = prefill_chunk
        self.compile_prefill = torch.device(device).type == "cuda" if compile_prefill is None else compile_prefill
        # how prefill multiplies the products held in e4m3 (runtime/prefill.py): w8a8 where torch._scaled_mm takes
        # block scales (Hopper), else w8a16
        if prefill_fp8 not in (None, *PREFILL_FP8):
            raise DistmkError(f"prefill_fp8 must be {' or '.join(PREFILL_FP8)}, got {prefill_fp8!r}")
        hopper = torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
        self.prefill_fp8 = prefill_fp8 or ("w8a8" if hopper else "w8a16")
        config = config or GraphConfig(**device_fields(backend, device,
                                                       ranks_on_device=getattr(self.comm, "ranks_on_device", 1)))
        bad = [b for b in step_batches if not 1 <= b <= config.batch]
        if bad:
            raise DistmkError(f"step_batches {bad} must lie in 1..{config.batch} (the rows of a step)")
        self.plan = plan_shard(self.spec, tp, rank)
        self.dtype, self.device, self.max_context = dtype, torch.device(device), max_context
        # the stream its steps run on (serve/lockstep.py on_engine_device): virtual ranks each have their own
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        # with kernel option stream_e4m3 the megakernel streams e4m3 products where the source has them (the
        # dequantized weights stay for the reference and prefill)
        self.weights = load_shard(self.spec, source, self.plan, dtype=dtype, device=device, progress=progress,
                                  keep_fp8=backend == "triton" and (kernel_options or {}).get("stream_e4m3") == 1)
        self.table = compile_step(self.spec, self.plan, config)
        self.config = self.table.config
        # KV-cache room: max_seqs sequences of max_context tokens (default: one per row of a step)
        self.kv = KVCache(self.spec.num_layers, max_seqs or self.config.batch, -(-max_context // block_size),
                          block_size, self.plan.num_kv_heads, self.spec.head_dim, dtype, device)
        self.prefill_graphs = ChunkGraphs(self, prefill_chunk) if (
            prefill_graphs and prefill_chunk and ChunkGraphs.applies(self)) else None
        self.executor = BACKENDS[backend](self, self.table, kernel_options or {}, autotune, progress)
        # A step runs the smallest table that holds its rows: a table lowered for fewer rows splits attention
        # over more workers (GraphConfig.resolved) and has no tasks for rows that are not there. The smaller
        # tables take the cached or default kernel options (tuning each would multiply the start-up time), and the
        # full table's kernel where products are held in e4m3: the ring and the tl kernel hold those in different
        # column orders (RankWeights.order_fp8)
        smaller = dict(kernel_options or {})
        if self.weights.fp8:
            smaller["kernel"] = self.executor.kernel_name
        self.executors = {b: BACKENDS[backend](self, compile_step(self.spec, self.plan,
                                                                   dataclasses.replace(config, batch=b)),
                                               smaller, False, progress)
                          for b in sorted(set(step_batches) - {self.config.batch})}
        self.executors[self.config.batch] = self.executor
        self.last_executor = self.executor

    def step(self, tokens, positions, block_tables):
        """Run one step: tokens[i] at positions[i] of the sequence whose blocks are block_tables[i].
        Returns the workspace: next_token (greedy, all ranks agree) and this rank's logits slice; next_tokens
        reads the former on the host."""
        self.last_executor = self.executor_for(len(tokens))
        return self.last_executor.step_rows(pack_rows(tokens, positions, block_tables, self.kv.blocks_per_seq))

    def next_tokens(self, n: int) -> list[int]:
        """The greedy tokens of the last step's first n rows, on the host (the triton executor brought them back
        with the watchdog's error word, in one copy)."""
        return self.last_executor.next_tokens(n)

    def decode(self, tokens, positions, block_tables, steps: int) -> list[list[int]]:
        """`steps` greedy steps of the same rows back to back, each row's token after the first the one the step
        before chose, at the next position, fed on the device (executor.step_next): the host waits for the
        device once, after the last. The rows' blocks must hold positions + steps - 1. Returns every step's
        token of each row."""
        n = len(tokens)
        executor = self.last_executor = self.executor_for(n)
        buf = executor.step_rows(pack_rows(tokens, positions, block_tables, self.kv.blocks_per_seq), wait=steps == 1)
        chosen = [buf["next_token"][:n].clone()]          # the next step overwrites next_token
        for i in range(1, steps):
            buf = executor.step_next(wait=i == steps - 1)
            chosen.append(buf["next_token"][:n].clone())
        return torch.stack(chosen).tolist()

    def executor_for(self, rows: int):
        """The executor of the smallest step table that holds `rows` rows (the full one if none is smaller)."""
        return self.executors[min((b for b in self.executors if b >= rows), default=self.config.batch)]

    def full_logits(self, buf, n: int) -> torch.Tensor:
        """[n, vocab] float32 logits of the last step, gathered from every rank's vocabulary slice."""
        shards = self.comm.gather(buf["logits"][:n])
        return torch.cat(shards, dim=-1)[:, :self.spec.vocab_size]

    def generate(self, prompt: list[int], max_new_tokens: int, params: SamplingParams | None = None,
                 stop_on_eos: bool = True, return_logits: bool = False):
        """Tokens generated after `prompt` (and, on request, the [steps, vocab] logits that chose them):
        one sequence through the same continuous batcher that serves many."""
        batcher = Batcher(self)
        seq = batcher.submit(Sequence(list(prompt), max_new_tokens, params or SamplingParams(), stop_on_eos,
                                      keep_logits=return_logits))
        try:
            while batcher.busy:
                batcher.step()
        finally:
            batcher.cancel(seq)                      # an error mid-way still returns the KV blocks
        if seq.error:
            raise DistmkError(seq.error)
        return (seq.output, torch.stack(seq.logits)) if return_logits else seq.output
