"""Rank 0's engine loop, on a thread of its own beside the HTTP event loop.

Requests and cancellations reach it through an inbox it empties between steps, so sequences join and
leave the batch only there. It steps while any sequence has work and otherwise sleeps on a condition,
waking every HEARTBEAT_S to let the other ranks show they are still there. The tokens of a step go back
to the event loop in one call; a listener (one per request) receives them there.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Protocol

import torch

from distmk.errors import DistmkError
from distmk.runtime.batcher import Batcher, PrefillInputs, Sequence, StepInputs
from distmk.runtime.sampling import TokenLogprob
from distmk.serve.lockstep import RankLost, on_engine_device

HEARTBEAT_S = 5.0


class Listener(Protocol):
    """Called on the event loop: each new token of the sequence (with its log-probabilities, and its prompt's, where
    the sequence asked for them), or a failure (a message for the client and its HTTP status: 503 when the engine is
    down, 500 when only this sequence failed). arrived: when its request arrived (time.monotonic), for the trace."""

    arrived: float

    def on_token(self, token: int, finish_reason: str | None, logprob: TokenLogprob | None = None,
                 prompt_logprobs: list[TokenLogprob] | None = None) -> None: ...

    def on_failure(self, message: str, status: int = 503) -> None: ...


class Scheduler:
    def __init__(self, engine, leader, metrics, max_running: int | None = None, steps_per_launch: int = 1,
                 trace=None, prefix_cache: bool = True):
        self.leader, self.metrics, self.trace = leader, metrics, trace     # trace: a metrics.StepTrace
        self.batcher = Batcher(engine, max_running, run=self._run, prefill=self._prefill,
                               steps_per_launch=steps_per_launch, prefix_cache=prefix_cache)
        self.cond = threading.Condition()
        self.inbox: list[tuple[str, Sequence, Listener | None, float]] = []      # (op, seq, listener, posted at)
        self.listeners: dict[int, Listener] = {}
        self.stopping = False
        self.failure: str | None = None       # why the loop died, if it did
        self.loop = self.thread = self.on_death = None

    def start(self, loop, on_death) -> None:
        """Run on a thread, delivering to `loop`; on_death() is called (from the thread) if it fails."""
        self.loop, self.on_death = loop, on_death
        self.thread = threading.Thread(target=self._main, name="distmk-scheduler", daemon=True)
        self.thread.start()

    def check(self, seq: Sequence) -> None:
        self.batcher.check(seq)

    def submit(self, seq: Sequence, listener: Listener) -> None:
        self._post("submit", seq, listener)

    def cancel(self, seq: Sequence) -> None:
        """Take the sequence out of the batch and free its KV blocks, before the next step."""
        self._post("cancel", seq, None)

    def stop(self, timeout: float) -> bool:
        """Finish the step under way, tell the other ranks to exit; False if that took over `timeout`."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)
        return not (self.thread and self.thread.is_alive())

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.failure is None

    def _post(self, op: str, seq: Sequence, listener: Listener | None) -> None:
        with self.cond:
            self.inbox.append((op, seq, listener, time.monotonic()))
            self.cond.notify()

    def _main(self) -> None:
        try:
            on_engine_device(self.batcher.engine)
            self._loop()
            self.leader.shutdown()
        except Exception as e:  # noqa: BLE001 - any failure ends serving; the message goes to every client
            self.failure = f"{type(e).__name__}: {e}" if not isinstance(e, DistmkError) else str(e)
            if not isinstance(e, RankLost):
                try:        # tell the other ranks now rather than leave them to their control timeout
                    self.leader.shutdown()
                except DistmkError:
                    pass
            with self.cond:
                listeners = list(self.listeners.values()) + [l for op, _, l, _ in self.inbox if op == "submit"]
            try:
                self.loop.call_soon_threadsafe(_fail_all, listeners, f"the engine failed: {self.failure}")
            except RuntimeError:    # the event loop already closed: no client is left to tell
                pass
            self.on_death()
        finally:
            if self.trace:
                self.trace.close()

    def _loop(self) -> None:
        while True:
            with self.cond:
                if not (self.inbox or self.batcher.busy or self.stopping):
                    self.cond.wait(HEARTBEAT_S)
                if self.stopping:
                    return
                idle = not (self.inbox or self.batcher.busy)
                inbox, self.inbox = self.inbox, []
            if idle:
                self.leader.heartbeat()
                continue
            for op, seq, listener, posted in inbox:
                if op == "cancel":
                    self.batcher.cancel(seq)
                    self.listeners.pop(seq.id, None)
                    continue
                try:
                    self.batcher.submit(seq)
                except DistmkError as e:             # refused: this request fails, the others go on
                    self.loop.call_soon_threadsafe(_fail_all, [listener], str(e))
                    continue
                self.listeners[seq.id] = listener
                if self.trace:
                    self.trace.request(seq.id, len(seq.prompt), listener.arrived, posted)
            produced = self.batcher.step()
            self.metrics.batcher_state(self.batcher)
            if produced:
                if self.trace:
                    self.trace.tokens([seq.id for seq, _ in produced])
                last = {seq.id: i for i, (seq, _) in enumerate(produced)}    # a sequence may get several tokens
                # a sequence that records log-probabilities has its steps one at a time: one token a step
                # the prompt's log-probabilities, where asked, are complete once its first token comes
                deliveries = [(self.listeners[seq.id], token, seq.finish_reason if last[seq.id] == i else None,
                               seq.error, seq.token_logprobs[-1] if seq.logprobs is not None and token is not None
                               else None, seq.prompt_token_logprobs if seq.prompt_logprobs is not None else None)
                              for i, (seq, token) in enumerate(produced)]
                for i in last.values():
                    if produced[i][0].finish_reason is not None:
                        del self.listeners[produced[i][0].id]
                self.loop.call_soon_threadsafe(_deliver, deliveries)

    def _span(self, kind: str, **fields):
        return self.trace.span(kind, **fields) if self.trace else contextlib.nullcontext()

    def _run(self, step: StepInputs):
        self.metrics.step_rows.observe(len(step.tokens))
        with self.metrics.step_time.time(), self._span("step", rows=len(step.tokens), steps=step.steps):
            return self.leader.run(step)

    def _prefill(self, chunk: PrefillInputs):
        """Run a chunk and wait for it, so that its histogram holds the chunk's time, not its launch's (a CUDA
        graph's replay returns at once; the next step would wait for it anyway); its logits where it has them."""
        with self.metrics.prefill_time.time(), self._span("prefill", rows=len(chunk.tokens), position=chunk.start):
            logits = self.leader.prefill(chunk)
            if self.batcher.engine.device.type == "cuda":
                torch.cuda.synchronize(self.batcher.engine.device)
        return logits


def _deliver(deliveries) -> None:
    """(listener, token, finish_reason, error, logprob, prompt logprobs) as they were after the step (the next may
    already run)."""
    for listener, token, finish_reason, error, logprob, prompt_logprobs in deliveries:
        if token is None:                     # this sequence failed (the others go on)
            listener.on_failure(error, status=500)
        else:
            listener.on_token(token, finish_reason, logprob, prompt_logprobs)


def _fail_all(listeners, message: str) -> None:
    for listener in listeners:
        listener.on_failure(message)
