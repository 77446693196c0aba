"""Continuous batching over an Engine: sequences join and leave between steps.

Each step first gives every decoding sequence one row (its last token), then fills the remaining rows with
a chunk of the oldest prompt still being read (chunked prefill), so a long prompt never stalls the
streams already running. A sequence's KV blocks are reserved when it is admitted (prompt + max_tokens)
and returned the moment it finishes or is cancelled.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from distmk.errors import DistmkError
from distmk.runtime.sampling import SamplingParams, sample


@dataclass
class Sequence:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams = field(default_factory=SamplingParams)
    stop_on_eos: bool = True
    id: int = field(default_factory=itertools.count().__next__)
    output: list[int] = field(default_factory=list)
    fed: int = 0                      # tokens of prompt + output already written to the KV cache
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "stop" or "cancelled"
    generator: torch.Generator | None = None
    keep_logits: bool = False         # record the [vocab] logits each new token was chosen from
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Batcher:
    def __init__(self, engine):
        self.engine = engine
        self.waiting: list[Sequence] = []     # admitted in arrival order once their KV blocks fit
        self.running: list[Sequence] = []

    def submit(self, seq: Sequence) -> Sequence:
        spec = self.engine.spec
        if not seq.prompt:
            raise DistmkError("the prompt is empty")
        if seq.max_tokens < 1:
            raise DistmkError(f"max_tokens must be >= 1, got {seq.max_tokens}")
        if len(seq.prompt) + seq.max_tokens > self.engine.max_context:
            raise DistmkError(f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.max_tokens}) exceeds the "
                              f"context of {self.engine.max_context} tokens")
        bad = [t for t in seq.prompt if not 0 <= t < spec.vocab_size]
        if bad:
            raise DistmkError(f"prompt token ids {bad[:5]} are outside the vocabulary 0..{spec.vocab_size - 1}")
        if seq.params.seed is not None:
            seq.generator = torch.Generator().manual_seed(seq.params.seed)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Sequence) -> None:
        if seq.finish_reason is None:
            self._finish(seq, "cancelled")

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        for queue in (self.waiting, self.running):
            if seq in queue:
                queue.remove(seq)
        self.engine.kv.release(seq.blocks)
        seq.blocks = []

    def _admit(self) -> None:
        """Running sequences are at most one per row, so each decodes every step."""
        kv = self.engine.kv
        while self.waiting and len(self.running) < self.engine.config.batch:
            seq = self.waiting[0]
            need = -(-(len(seq.prompt) + seq.max_tokens) // kv.block_size)
            if need > len(kv.free):
                return                                   # wait for running sequences to free blocks
            seq.blocks = kv.allocate([], len(seq.prompt) + seq.max_tokens)
            self.running.append(self.waiting.pop(0))

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[tuple[Sequence, int]]:
        """One engine step; returns the (sequence, new token) pairs it produced. Finished sequences have
        finish_reason set and are out of the batch."""
        self._admit()
        rows = self.engine.config.batch
        batch: list[tuple[Sequence, int]] = []           # (sequence, index into its tokens) per row
        for seq in self.running:                          # decode rows first: running streams never stall
            if seq.output:
                batch.append((seq, seq.fed))
                seq.fed += 1
        for seq in self.running:                          # then prompt chunks, oldest first
            while seq.fed < len(seq.prompt) and len(batch) < rows:
                batch.append((seq, seq.fed))
                seq.fed += 1
        if not batch:
            return []
        buf = self.engine.step([seq.tokens[i] for seq, i in batch], [i for _, i in batch],
                               [seq.blocks for seq, _ in batch])
        produced = []
        needs_logits = any(seq.keep_logits or not seq.params.greedy for seq, _ in batch)
        logits = self.engine.full_logits(buf, len(batch)) if needs_logits else None
        for row, (seq, i) in enumerate(batch):
            if i != len(seq.tokens) - 1:                   # a prompt row that is not the prompt's last
                continue
            token = int(buf["next_token"][row]) if seq.params.greedy else sample(logits[row], seq.params,
                                                                                 seq.generator)
            seq.output.append(token)
            if seq.keep_logits:
                seq.logits.append(logits[row])
            produced.append((seq, token))
            if seq.stop_on_eos and token in self.engine.spec.eos_token_id:
                self._finish(seq, "stop")
            elif len(seq.output) >= seq.max_tokens:
                self._finish(seq, "length")
        return produced
