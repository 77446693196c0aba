"""The server's Prometheus metrics (GET /metrics), in a registry of its own so that two servers in one
process (tests) do not collide, and its optional timeline of steps (--trace-steps)."""
from __future__ import annotations

import contextlib
import json
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics

from distmk.errors import DistmkError

disable_created_metrics()      # no *_created series: scrapers know when they started

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 20.0, 40.0, 80.0)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self, kv_blocks: int):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.requests = Counter("distmk_requests", "HTTP responses of the API, by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("distmk_requests_finished", "Generations that ended, by reason (stop, length, "
                                "cancelled: the client went away, error: the engine failed or the server stopped)", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("distmk_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.prefix_queries = Counter("distmk_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("distmk_prefix_cache_hits", "Prompt tokens found in the prefix cache (their "
                                   "KV blocks reused, not read again)", registry=r)
        self.generation_tokens = Counter("distmk_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("distmk_time_to_first_token_seconds", "From a request's arrival to its first "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("distmk_inter_token_latency_seconds", "Between consecutive tokens of a sequence",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("distmk_request_latency_seconds", "From a request's arrival to its last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.step_rows = Histogram("distmk_step_rows", "Rows (tokens) per engine step: the batch size",
                                   buckets=ROW_BUCKETS, registry=r)
        self.step_time = Histogram("distmk_step_seconds", "Time of an engine step on rank 0: the plan sent to "
                                   "the other ranks, the step, its tokens on the host (sampling not included)",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("distmk_prefill_seconds", "Time of a prompt's prefill chunk on rank 0",
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("distmk_running_sequences", "Sequences in the batch", registry=r)
        self.waiting = Gauge("distmk_waiting_sequences", "Sequences queued for the batch", registry=r)
        self.kv_used = Gauge("distmk_kv_cache_used_blocks", "KV-cache blocks held by sequences (cached blocks "
                              "that none holds count as free)", registry=r)
        self.kv_usage = Gauge("distmk_kv_cache_usage_ratio", "Fraction of the KV-cache blocks in use", registry=r)
        Gauge("distmk_kv_cache_blocks", "KV-cache blocks in all", registry=r).set(kv_blocks)
        self.kv_blocks = kv_blocks
        self.counted = (0, 0)       # the batcher's prefix-cache totals already added to the counters

    def batcher_state(self, batcher) -> None:
        """Queue, KV-cache and prefix-cache figures, after each step or cancellation."""
        used = self.kv_blocks - batcher.engine.kv.available
        queried, hits = self.counted
        self.prefix_queries.inc(batcher.prefix_queried - queried)
        self.prefix_hits.inc(batcher.prefix_hits - hits)
        self.counted = (batcher.prefix_queried, batcher.prefix_hits)
        self.running.set(len(batcher.running))
        self.waiting.set(len(batcher.waiting))
        self.kv_used.set(used)
        self.kv_usage.set(used / self.kv_blocks)


class StepTrace:
    """--trace-steps FILE: JSON lines on rank 0, on time.monotonic's clock in seconds: every engine launch and
    prefill chunk (rows, start, end), every request the scheduler takes in (when it arrived, was handed over and
    taken in), and after each scheduler iteration the sequences that got tokens from it (one id a token). The
    timeline behind /metrics' histograms: what ran between two tokens of a stream, or before a request's first,
    a prefill chunk or the loop's host work (benchmarks/step_trace.py reads it)."""

    def __init__(self, path: str):
        try:
            self.file = open(path, "w", buffering=1 << 16)
        except OSError as e:
            raise DistmkError(f"--trace-steps {path}: {e.strerror}") from None

    def write(self, kind: str, **fields) -> None:
        self.file.write(json.dumps({"kind": kind, **fields}) + "\n")

    @contextlib.contextmanager
    def span(self, kind: str, **fields):
        start = time.monotonic()
        yield
        self.write(kind, **fields, start=round(start, 6), end=round(time.monotonic(), 6))

    def request(self, sequence_id: int, prompt_tokens: int, arrived: float, submitted: float) -> None:
        self.write("request", id=sequence_id, prompt=prompt_tokens, arrived=round(arrived, 6),
                   submitted=round(submitted, 6), time=round(time.monotonic(), 6))

    def tokens(self, sequence_ids: list[int]) -> None:
        self.write("tokens", time=round(time.monotonic(), 6), ids=sequence_ids)

    def close(self) -> None:
        self.file.close()
