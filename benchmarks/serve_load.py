"""Load test of a running distmk.serve (or any OpenAI-compatible server): C clients send N streamed
completions in all, and one JSON object reports time to first token, inter-token latency, and request and
token throughput.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64 \\
        --max-tokens 128 --prompt-len 256

Prompts are random token ids (seeded) below --vocab-limit, so their length is exact whatever the
tokenizer; ignore_eos makes every request generate exactly --max-tokens tokens. Each streamed chunk
carries one token (distmk.serve sends one per token), so the gaps between chunks are inter-token latencies.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    p.add_argument("--requests", type=int, default=64, help="requests in all")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--vocab-limit", type=int, default=256, help="prompt token ids are drawn from 1..this-1")
    p.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    return p.parse_args(argv)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
    return {"p50": round(at(0.50), 6), "p99": round(at(0.99), 6), "mean": round(statistics.fmean(values), 6)}


async def one_request(http: httpx.AsyncClient, body: dict) -> dict:
    """Send one streamed completion; the arrival times of its token chunks."""
    start = time.perf_counter()
    arrivals, usage = [], None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"]:
                arrivals.append(time.perf_counter())
    return {"start": start, "arrivals": arrivals, "end": time.perf_counter(), "usage": usage}


async def run(args) -> dict:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=args.timeout, limits=limits) as http:
        model = args.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        bodies = [{"model": model, "prompt": [rng.randrange(1, args.vocab_limit) for _ in range(args.prompt_len)],
                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}} for _ in range(args.requests)]
        pending = iter(bodies)
        results = []

        async def client():
            for body in pending:
                results.append(await one_request(http, body))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        duration = time.perf_counter() - t0
    done = [r for r in results if "error" not in r]
    errors = sorted({r["error"] for r in results if "error" in r})
    ttft = [r["arrivals"][0] - r["start"] for r in done if r["arrivals"]]
    itl = [b - a for r in done for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tokens = sum(r["usage"]["completion_tokens"] if r["usage"] else len(r["arrivals"]) for r in done)
    return {"url": args.url, "model": model, "concurrency": args.concurrency, "requests": args.requests,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "completed": len(done),
            "failed": len(results) - len(done), "errors": errors[:5], "duration_s": round(duration, 3),
            "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "request_throughput_per_s": round(len(done) / duration, 3),
            "output_token_throughput_per_s": round(tokens / duration, 2), "output_tokens": tokens}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_tokens < 1 or args.prompt_len < 1:
        print("error: --concurrency, --requests, --max-tokens and --prompt-len must be >= 1", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run(args))
    except httpx.TransportError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
