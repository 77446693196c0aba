"""A request's sequence as the event loop sees it: the scheduler hands its tokens over (Generation is its
listener), they are decoded a piece at a time and cut at the first stop string (StopStrings); a streamed reply is a
response of server-sent events that closes its generations however it ends (GenerationStream)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from distmk.runtime.batcher import Sequence
from distmk.runtime.sampling import TokenLogprob
from distmk.runtime.tokenizer import IncrementalDecoder
from distmk.serve.protocol import APIError

if TYPE_CHECKING:
    from distmk.serve.app import Served


class StopStrings:
    """Cuts text at the first stop string to appear, holding back a tail that may be the start of one.

    Each stop string keeps its Knuth-Morris-Pratt state (how long a start of it the text ends with), so
    each character of the text is looked at once per stop string: linear in the text, however long the
    stop strings are. Of stop strings completed by the same character, the longest wins. The text sent ends
    before the stop string, or after it for those in `kept` (vLLM's include_stop_str_in_output)."""

    def __init__(self, stops: list[str], kept: frozenset[str] = frozenset()):
        self.stops, self.kept, self.pending = stops, kept, ""
        self.fallback = [_kmp_fallback(s) for s in stops]
        self.matched = [0] * len(stops)

    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string was reached)."""
        for end, char in enumerate(text, 1):
            completed = ""
            for i, stop in enumerate(self.stops):
                k = self.matched[i]
                while k and stop[k] != char:
                    k = self.fallback[i][k - 1]
                if stop[k] == char:
                    k += 1
                if k == len(stop) and k > len(completed):
                    completed = stop
                self.matched[i] = k
            if completed:
                seen = self.pending + text[:end]          # the stop string lies in what is not sent yet
                self.pending = ""
                return (seen if completed in self.kept else seen[:len(seen) - len(completed)]), True
        seen = self.pending + text
        hold = 0 if final else max(self.matched, default=0)
        out, self.pending = seen[:len(seen) - hold], seen[len(seen) - hold:]
        return out, False


def _kmp_fallback(s: str) -> list[int]:
    """fallback[k - 1]: the longest proper prefix of s[:k] that is also a suffix of it."""
    fallback, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fallback[k - 1]
        if s[i] == s[k]:
            k += 1
        fallback[i] = k
    return fallback


class Aborted(Exception):
    """The request cannot finish: the engine failed or the server is shutting down (503), or something
    went wrong with this request alone (500)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status

    def as_api_error(self) -> "APIError":
        return APIError(self.status, str(self), type="server_error")


@dataclass
class Piece:
    text: str
    token: int
    finish_reason: str | None
    logprob: TokenLogprob | None = None     # where the request asked for log-probabilities


class Generation:
    """One request's sequence, seen from the event loop. It is the scheduler's listener for it."""

    def __init__(self, served: Served, seq: Sequence, stops: list[str], arrived: float,
                 kept_stops: frozenset[str] = frozenset()):
        self.served, self.seq, self.arrived = served, seq, arrived
        self.queue: asyncio.Queue = asyncio.Queue()
        self.decoder = IncrementalDecoder(served.tokenizer)
        self.stop = StopStrings(stops, kept_stops)
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.last_token_at: float | None = None
        self.started = self.closed = False
        self.engine_done = False           # the engine finished the sequence (length or EOS)
        self.prompt_logprobs: list[TokenLogprob] | None = None     # of prompt[1:], with the first token

    def start(self) -> None:
        served = self.served
        served.check_admission()
        served.live.add(self)
        self.started = True
        served.metrics.prompt_tokens.inc(len(self.seq.prompt))
        served.scheduler.submit(self.seq, self)

    def on_token(self, token: int, finish_reason: str | None, logprob: TokenLogprob | None = None,
                 prompt_logprobs: list[TokenLogprob] | None = None) -> None:
        self.engine_done = finish_reason is not None
        if not self.closed:
            self.queue.put_nowait((token, finish_reason, logprob, prompt_logprobs))

    def on_failure(self, message: str, status: int = 503) -> None:
        if not self.closed:
            self.queue.put_nowait(Aborted(message, status))

    async def pieces(self):
        metrics = self.served.metrics
        while self.finish_reason is None:
            item = await self.queue.get()
            if isinstance(item, Aborted):
                self.finish_reason = "error"
                raise item
            token, finish_reason, logprob, prompt_logprobs = item
            self.prompt_logprobs = self.prompt_logprobs or prompt_logprobs
            now = time.monotonic()
            if self.last_token_at is None:
                metrics.ttft.observe(now - self.arrived)
            else:
                metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            metrics.generation_tokens.inc()
            self.tokens.append(token)
            try:
                text = self.decoder.push(token) + (self.decoder.flush() if finish_reason else "")
                stopped = False
                if len(self.tokens) >= self.seq.min_tokens:       # vLLM's: no stop string before min_tokens
                    text, stopped = self.stop.feed(text, final=finish_reason is not None)
            except Exception as e:  # noqa: BLE001 - decoding or stop strings failed for this request only
                self.finish_reason = "error"
                raise Aborted(f"decoding the output failed: {type(e).__name__}: {e}", status=500) from None
            if stopped and finish_reason is None:
                self.served.scheduler.cancel(self.seq)         # frees its KV blocks before the next step
            self.finish_reason = "stop" if stopped else finish_reason
            yield Piece(text, token, self.finish_reason, logprob)

    def close(self) -> None:
        """Whatever ended the request (its client left, a stop string, an abort): a sequence the engine
        has not finished is cancelled."""
        if self.closed or not self.started:
            return
        self.closed = True
        served = self.served
        served.live.discard(self)
        if not self.engine_done:
            served.scheduler.cancel(self.seq)
        served.metrics.finished.labels(self.finish_reason or "cancelled").inc()
        if self.finish_reason in ("stop", "length"):
            served.metrics.latency.observe(time.monotonic() - self.arrived)


class GenerationStream(StreamingResponse):
    """Server-sent events of a request's generations (one a choice); closes them however the response ends (a
    client that disconnects cancels the response task, which lands here)."""

    def __init__(self, generations: list[Generation], events):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generations = generations

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()       # its tasks end with it (a client that left: Starlette does not)
            for generation in self.generations:
                generation.close()
