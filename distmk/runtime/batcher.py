"""Continuous batching over an Engine: sequences join and leave between steps.

Each step first gives every decoding sequence one row (its last token), then fills the remaining rows with
a chunk of the oldest prompt still being read (chunked prefill), so a long prompt never stalls the
streams already running. A prompt longer than a step's rows goes, chunk by chunk (one chunk before each
step), through the prefill path instead (runtime/prefill.py: GEMMs rather than the decode graph's GEMVs): its
last chunk's last row gives the sequence its first token, or, where what is left after a chunk fits in a step's
rows, that step does. While no sequence decodes the chunks run back to back; while some do, their steps' free rows read
the prompt too. A sequence's KV blocks are reserved when it is admitted (prompt + max_tokens) and returned the
moment it finishes or is cancelled. With the prefix cache (on by default) a sequence starts from the longest run of
full blocks of its prompt that earlier sequences wrote (their tokens and every token before them the same: kv_cache.py),
and the full blocks it writes are offered to later ones as soon as they are in the cache; one whose prompt goes on with
a block that a running sequence is still writing (a request's n choices) waits until it is. A prompt always reads
its last token: that row gives its first token.

A step is planned as plain data (StepInputs) and run by a function the caller may replace: under tensor
parallelism the server's rank 0 plans every step and sends it to the other ranks before running it, so
all ranks run identical steps while only rank 0 holds sequences and samples.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch

from distmk.errors import DistmkError
from distmk.runtime.kv_cache import block_hashes
from distmk.runtime.prefill import prefill_chunk
from distmk.runtime.sampling import SamplingParams, TokenLogprob, sample, token_logprobs


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
    finish_reason: str | None = None  # "length", "stop", "cancelled" or "error"
    error: str | None = None          # why it failed, with finish_reason "error"
    generator: torch.Generator | None = None
    keep_logits: bool = False         # record the [vocab] logits each new token was chosen from
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: int | None = None       # record each new token's log-probability and its k most likely alternatives
    stop_tokens: frozenset[int] = frozenset()   # token ids that end it as an end of sequence does (even past eos)
    min_tokens: int = 0               # until the output holds this many, no token that would end it is chosen
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    # record each prompt token's log-probability (given the tokens before it) and its k most likely alternatives:
    # from the logits of its prefill chunks (which then compute them) and of the steps' prompt rows
    prompt_logprobs: int | None = None
    prompt_token_logprobs: list[TokenLogprob] = field(default_factory=list)     # of prompt[1:]
    cached_tokens: int = 0            # prompt tokens found in the prefix cache at admission (not read again)
    block_hashes: list[bytes] = field(default_factory=list)    # of its full blocks (kv_cache.block_hashes), so far
    registered: int = 0               # of its blocks, those offered to the prefix cache
    # the tokens a grammar allows (runtime/structured.py Constraint): the logits are masked to them before a token
    # is chosen, and the sequence stops once the grammar is complete
    constraint: object | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token(self, i: int) -> int:
        """tokens[i], without copying the whole list as `tokens` does (the batcher asks for one a row, every
        step)."""
        return self.prompt[i] if i < len(self.prompt) else self.output[i - len(self.prompt)]


@dataclass
class StepInputs:
    """One step as every tensor-parallel rank must run it: row i feeds tokens[i] at positions[i] of the
    sequence whose KV blocks are block_tables[i]; needs_logits asks for the gathered logits (a collective).
    steps > 1: that many greedy decode steps back to back (Engine.decode), without logits."""
    tokens: list[int]
    positions: list[int]
    block_tables: list[list[int]]
    needs_logits: bool
    steps: int = 1


@dataclass
class PrefillInputs:
    """A chunk of one sequence's prompt for the prefill path, as every rank must run it: tokens at positions
    start, start + 1, ... of the sequence whose KV blocks are `blocks`; logits: with every position's logits;
    last: the chunk ends the prompt (with its last position's logits, which give the first token)."""
    tokens: list[int]
    start: int
    blocks: list[int]
    logits: bool = False
    last: bool = False


def run_prefill(engine, chunk: PrefillInputs) -> torch.Tensor | None:
    return prefill_chunk(engine, chunk.tokens, chunk.start, chunk.blocks, chunk.logits, chunk.last)


def run_step(engine, step: StepInputs) -> tuple[list[list[int]], torch.Tensor | None]:
    """Run a planned step on this rank: the greedy token of every row in each of its steps (a list a step),
    and the [rows, vocab] logits when the step needs them."""
    if step.steps > 1:
        return engine.decode(step.tokens, step.positions, step.block_tables, step.steps), None
    buf = engine.step(step.tokens, step.positions, step.block_tables)
    rows = len(step.tokens)
    return [engine.next_tokens(rows)], engine.full_logits(buf, rows) if step.needs_logits else None


class Batcher:
    """max_running: sequences decoding at once (default and at most: the rows of a step, one each);
    fewer leaves rows of every step for prompt chunks. run, prefill: how a planned step and a prefill chunk
    are run (default: on this rank only). Prefill chunks hold up to engine.prefill_chunk tokens (0: every
    prompt goes through the steps). steps_per_launch > 1: while every running sequence decodes greedily and
    no request waits, up to that many steps run back to back with no host round trip between them (their
    tokens then arrive together). prefix_cache: sequences start from the cached blocks of their prompt's prefix."""

    def __init__(self, engine, max_running: int | None = None,
                 run: Callable[[StepInputs], tuple[list[list[int]], torch.Tensor | None]] | None = None,
                 prefill: Callable[[PrefillInputs], torch.Tensor | None] | None = None,
                 steps_per_launch: int = 1, prefix_cache: bool = True):
        self.engine, self.prefix_cache = engine, prefix_cache
        self.prefix_queried = self.prefix_hits = 0      # prompt tokens looked up in the prefix cache, and found
        rows = engine.config.batch
        if max_running is not None and not 1 <= max_running <= rows:
            raise DistmkError(f"max_running must be in 1..{rows} (the rows of a step), got {max_running}")
        self.max_running = max_running or rows
        if steps_per_launch < 1:
            raise DistmkError(f"steps_per_launch must be >= 1, got {steps_per_launch}")
        self.steps_per_launch = steps_per_launch
        self.run = run or (lambda step: run_step(engine, step))
        self.prefill = prefill or (lambda chunk: run_prefill(engine, chunk))
        self.waiting: list[Sequence] = []     # admitted in arrival order once their KV blocks fit
        self.running: list[Sequence] = []
        self.step_next = False                # the last call returned a chunk's first token: this one steps first

    def check(self, seq: Sequence) -> None:
        """Raise DistmkError if the sequence can never run here. Reads only the engine's fixed limits, so
        another thread may call it while steps run."""
        spec = self.engine.spec
        if not seq.prompt:
            raise DistmkError("the prompt is empty")
        if seq.max_tokens < 1:
            raise DistmkError(f"max_tokens must be >= 1, got {seq.max_tokens}")
        if len(seq.prompt) + seq.max_tokens > self.engine.max_context:
            raise DistmkError(f"prompt ({len(seq.prompt)} tokens) + max_tokens ({seq.max_tokens}) exceeds the "
                              f"context of {self.engine.max_context} tokens")
        for what, ids in (("prompt token ids", seq.prompt), ("stop token ids", sorted(seq.stop_tokens))):
            bad = [t for t in ids if not 0 <= t < spec.vocab_size]
            if bad:
                raise DistmkError(f"{what} {bad[:5]} are outside the vocabulary 0..{spec.vocab_size - 1}")

    def submit(self, seq: Sequence) -> Sequence:
        self.check(seq)
        if seq.params.seed is not None:
            seq.generator = torch.Generator(self.engine.device).manual_seed(seq.params.seed)
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
        self._offer_blocks(seq)
        self.engine.kv.release(seq.blocks)
        seq.blocks = []

    def _caches(self, seq: Sequence) -> bool:
        """Whether the sequence reads and offers cached blocks (one that records its prompt's log-probabilities
        reads every prompt token)."""
        return self.prefix_cache and seq.prompt_logprobs is None

    def _admit(self) -> None:
        """Running sequences are at most one per row, so each decodes every step. A sequence whose prompt goes on
        with a block that a running one is still writing (the choices of one request, prompts sent together) waits
        until it is cached rather than reading it again; those behind it may start meanwhile."""
        kv = self.engine.kv
        writing = {h for seq in self.running if self._caches(seq) for h in seq.block_hashes[seq.registered:]}
        for seq in list(self.waiting):
            if len(self.running) >= self.max_running:
                return
            caching = self._caches(seq)
            if caching and not seq.block_hashes:
                seq.block_hashes = block_hashes(seq.prompt, kv.block_size)
            # cached blocks up to the prompt's last token, which is always read
            usable = seq.block_hashes[:(len(seq.prompt) - 1) // kv.block_size] if caching else []
            cached = kv.match(usable)
            if len(cached) < len(usable) and usable[len(cached)] in writing:
                continue
            need = -(-(len(seq.prompt) + seq.max_tokens) // kv.block_size) - len(cached)
            if need > kv.available - sum(b in kv.evictable for b in cached):
                return                                   # wait for running sequences to free blocks
            kv.share(cached)
            seq.blocks = kv.allocate(cached, len(seq.prompt) + seq.max_tokens)
            seq.fed = seq.cached_tokens = len(cached) * kv.block_size
            seq.registered = len(cached)
            if caching:
                self.prefix_queried += len(seq.prompt)
                self.prefix_hits += seq.cached_tokens
                writing.update(seq.block_hashes[seq.registered:])
            self.waiting.remove(seq)
            self.running.append(seq)

    def _offer_blocks(self, seq: Sequence) -> None:
        """Offer the prefix cache the sequence's full blocks that the steps (and prefill chunks) so far wrote."""
        if not self._caches(seq):
            return
        kv = self.engine.kv
        full = min(seq.fed // kv.block_size, len(seq.blocks))
        if full > len(seq.block_hashes):
            start = len(seq.block_hashes)
            seq.block_hashes += block_hashes(seq.tokens[:full * kv.block_size], kv.block_size,
                                             seq.block_hashes[-1] if start else b"", start)
        for b in range(seq.registered, full):
            kv.register(seq.blocks[b], seq.block_hashes[b])
        seq.registered = max(seq.registered, full)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _prefills(self, seq: Sequence) -> bool:
        """Whether the sequence's unread prompt still goes to a prefill chunk: it is more than a step's rows (and
        the engine prefills by chunks)."""
        return bool(self.engine.prefill_chunk) and len(seq.prompt) - seq.fed > self.engine.config.batch

    def plan_prefill(self) -> tuple[Sequence, PrefillInputs] | None:
        """The next prefill chunk and its sequence: of the oldest running sequence whose unread prompt still goes
        to one; None if there is none."""
        self._admit()
        for seq in self.running:
            if self._prefills(seq):
                n = min(self.engine.prefill_chunk, len(seq.prompt) - seq.fed)
                chunk = PrefillInputs(seq.prompt[seq.fed:seq.fed + n], seq.fed, seq.blocks,
                                      logits=seq.prompt_logprobs is not None, last=seq.fed + n == len(seq.prompt))
                seq.fed += n
                return seq, chunk
        return None

    def plan(self) -> tuple[list[tuple[Sequence, int]], StepInputs] | None:
        """Admit what fits and lay out the next step: (sequence, index into its tokens) per row, and the
        step's inputs; None when no sequence has a row to run."""
        self._admit()
        rows = self.engine.config.batch
        batch: list[tuple[Sequence, int]] = []
        for seq in self.running:                          # decode rows first: running streams never stall
            if seq.output:
                batch.append((seq, seq.fed))
                seq.fed += 1
        if not batch and all(self._prefills(seq) for seq in self.running if seq.fed < len(seq.prompt)):
            return None          # a step of prompt rows alone would only delay the prompts' next chunks
        for seq in self.running:                          # then prompt chunks, oldest first
            if seq.fed == 0 and self._prefills(seq):
                continue        # its prefill chunks come first: the first attends to its own keys alone
            while seq.fed < len(seq.prompt) and len(batch) < rows:
                batch.append((seq, seq.fed))
                seq.fed += 1
        if not batch:
            return None
        needs_logits = any(seq.keep_logits or seq.logprobs is not None or seq.params.needs_logits
                           or seq.constraint is not None
                           or (self._held_back(seq) and i == len(seq.prompt) + len(seq.output) - 1)
                           or (seq.prompt_logprobs is not None and i < len(seq.prompt) - 1) for seq, i in batch)
        steps = 1
        if self.steps_per_launch > 1 and not needs_logits and not self.waiting and all(s.output for s, _ in batch):
            # every row decodes: a sequence's reserved blocks hold its max_tokens, so none steps past them
            steps = min(self.steps_per_launch, *(s.max_tokens - len(s.output) for s, _ in batch))
        return batch, StepInputs([seq.token(i) for seq, i in batch], [i for _, i in batch],
                                 [seq.blocks for seq, _ in batch], needs_logits, steps)

    def step(self) -> list[tuple[Sequence, int | None]]:
        """One engine step (or several back to back, see steps_per_launch); returns the (sequence, new token)
        pairs it produced, in order. Finished sequences have finish_reason set and are out of the batch. A
        sequence whose token cannot be sampled fails alone: its pair has no token, its finish_reason is "error"
        and its error says why. A prefill chunk, if a prompt needs one, runs first; where it gives its sequence the
        first token, that returns at once (it is the time to first token) and the next call runs the step, with
        no chunk before it."""
        produced = []
        prefill = None if self.step_next else self.plan_prefill()
        self.step_next = False
        if prefill is not None:
            seq, chunk = prefill
            logits = self.prefill(chunk)
            self._offer_blocks(seq)
            if chunk.logits:            # position p's logits give prompt token p + 1's log-probability
                n = len(chunk.tokens) - chunk.last
                try:
                    seq.prompt_token_logprobs += token_logprobs(
                        logits[:n], seq.prompt[chunk.start + 1:chunk.start + n + 1], [seq.prompt_logprobs] * n)
                except Exception as e:  # noqa: BLE001 - this sequence fails, the others go on
                    self._fail_logprobs([seq], e, produced)
            if chunk.last and seq.finish_reason is None:
                self._first_token(seq, logits[-1], produced)
            if produced:
                self.step_next = True
                return produced
        planned = self.plan()
        if planned is None:
            return produced
        batch, inputs = planned
        greedy, logits = self.run(inputs)
        asked = []              # (row, sequence) of the new tokens whose logprobs are recorded
        for row, (seq, i) in enumerate(batch):
            if i != len(seq.prompt) + len(seq.output) - 1:     # a prompt row that is not the prompt's last
                if seq.prompt_logprobs is not None:
                    asked.append((row, seq))
                continue
            if self._next_token(seq, None if logits is None else logits[row], greedy[0][row], produced) \
                    and seq.logprobs is not None:
                asked.append((row, seq))
        if asked:               # every row's at once: one copy to the host, not a few per row
            # a prompt row's logits give the next prompt token's log-probability, the last row's the new token's
            in_prompt = [batch[row][1] < len(seq.prompt) - 1 for row, seq in asked]
            rows = [row for row, _ in asked]
            chosen = [seq.prompt[batch[row][1] + 1] if prompt else seq.output[-1]
                      for (row, seq), prompt in zip(asked, in_prompt)]
            ks = [seq.prompt_logprobs if prompt else seq.logprobs for (_, seq), prompt in zip(asked, in_prompt)]
            try:
                found = token_logprobs(logits[rows], chosen, ks)
            except Exception as e:  # noqa: BLE001 - these sequences fail, the others go on
                self._fail_logprobs(dict.fromkeys(seq for _, seq in asked), e, produced)
            else:
                for (_, seq), prompt, logprob in zip(asked, in_prompt, found):
                    (seq.prompt_token_logprobs if prompt else seq.token_logprobs).append(logprob)
        for later in greedy[1:]:                # back-to-back steps: every row a greedy decoding sequence
            for row, (seq, _) in enumerate(batch):
                if seq.finish_reason is None:
                    seq.fed += 1                # the token the step before chose went in at its position
                    self._produce(seq, later[row], produced)
        for seq in self.running:
            self._offer_blocks(seq)
        return produced

    def _held_back(self, seq: Sequence) -> list[int]:
        """The tokens that would end the sequence, while its output is shorter than its min_tokens (and no grammar
        decides where it ends)."""
        if len(seq.output) >= seq.min_tokens or seq.constraint is not None:
            return []
        return sorted(seq.stop_tokens | (set(self.engine.spec.eos_token_id) if seq.stop_on_eos else set()))

    def _next_token(self, seq: Sequence, logits: torch.Tensor | None, greedy: int, produced: list) -> bool:
        """Choose the sequence's next token from its row's [vocab] logits (`greedy`: their argmax, where the
        sequence asks for no more) and produce it; False where it could not be sampled: the sequence then failed
        alone (its pair has no token)."""
        held = self._held_back(seq)
        try:
            if seq.constraint is not None:
                token = sample(seq.constraint.mask(logits), seq.params, seq.generator, seq.prompt, seq.output)
                seq.constraint.accept(token)
            elif held:
                token = sample(logits.index_fill(0, torch.tensor(held, device=logits.device), float("-inf")),
                               seq.params, seq.generator, seq.prompt, seq.output)
            else:
                token = sample(logits, seq.params, seq.generator, seq.prompt, seq.output) \
                    if seq.params.needs_logits else greedy
        except Exception as e:  # noqa: BLE001 - whatever it was, it concerns this sequence only
            seq.error = f"sampling failed: {e}"
            self._finish(seq, "error")
            produced.append((seq, None))
            return False
        if seq.keep_logits:
            seq.logits.append(logits)
        self._produce(seq, token, produced)
        return True

    def _first_token(self, seq: Sequence, logits: torch.Tensor, produced: list) -> None:
        """The first token, from the [vocab] logits of the prompt's last position that its last prefill chunk
        computed, with its log-probability where asked."""
        if self._next_token(seq, logits, int(logits.argmax()), produced) and seq.logprobs is not None:
            try:
                seq.token_logprobs += token_logprobs(logits[None], [seq.output[-1]], [seq.logprobs])
            except Exception as e:  # noqa: BLE001 - this sequence fails, the others go on
                self._fail_logprobs([seq], e, produced)

    def _fail_logprobs(self, seqs, error: Exception, produced: list) -> None:
        for seq in seqs:
            if seq.finish_reason is None:
                seq.logprobs = seq.prompt_logprobs = None
                seq.error = f"log-probabilities failed: {error}"
                self._finish(seq, "error")
                produced.append((seq, None))

    def _produce(self, seq: Sequence, token: int, produced: list) -> None:
        seq.output.append(token)
        produced.append((seq, token))
        if ((seq.stop_on_eos and token in self.engine.spec.eos_token_id) or token in seq.stop_tokens
                or (seq.constraint is not None and seq.constraint.complete)):
            self._finish(seq, "stop")
        elif len(seq.output) >= seq.max_tokens:
            self._finish(seq, "length")
