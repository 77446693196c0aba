"""Load test of a running distmk.serve (or any OpenAI-compatible server): C clients send N streamed
completions in all, and one JSON object reports time to first token, inter-token latency, and request and
token throughput.

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64 \\
        --max-tokens 128 --prompt-len 256

With --matrix, one such run per (streams, prompt length) cell against the same server, each stream sending
--rounds requests, after one untimed request per prompt length (the first of a length may compile or pick
kernels); one JSON with every cell (with distmk.serve's own mean step and prefill-chunk times over the cell,
from its /metrics), and a PNG of TTFT and inter-token latency against prompt length, a line
per stream count (matplotlib: pip install -e '.[bench]'):

    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --matrix --streams 1,8 --prompt-lens 256,2000 \\
        --max-tokens 128 --out serve_matrix.json          # and serve_matrix.png

The matrix also has a shared-prefix cell per stream count: every prompt the same --shared-prefix tokens (2000;
0: none) then 64 of its own, as a chat resends its system prompt and history, after one untimed request has
sent that prefix (a server with prefix caching holds its KV then: the cell's cached_tokens_mean says how much).

With --features, the costs of two request features, each cell beside the same requests without it against one
server (one stream, --rounds requests a cell, after an untimed request of each kind):

- `json_schema`: --max-tokens tokens of 256-token prompts under a `response_format` JSON schema (an array of
  strings), their inter-token latency against unconstrained decoding's;
- `prompt_logprobs`: fresh prompts of --prompt-lens' longest length (no cached prefix) with their log-probabilities
  (`echo`, `logprobs: 1`, `max_tokens: 0`), each request's whole time against one token of the same length
  (`max_tokens: 1`): the plain prefill; both not streamed, as lm-eval sends them.

Prompts are random token ids (seeded) below --vocab-limit, so their length is exact whatever the
tokenizer; ignore_eos makes every request generate exactly --max-tokens tokens. Each streamed chunk
carries one token (distmk.serve sends one per token), so the gaps between chunks are inter-token latencies.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import statistics
import sys
import time

import httpx


def counts(text: str) -> list[int]:
    """A comma-separated list of positive integers (--streams, --prompt-lens)."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


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
    p.add_argument("--matrix", action="store_true",
                   help="one run per --streams x --prompt-lens cell instead of --concurrency/--requests/--prompt-len")
    p.add_argument("--streams", type=counts, default=[1, 8], help="matrix: clients sending at once, per cell")
    p.add_argument("--prompt-lens", type=counts, default=[256, 2000], help="matrix: prompt tokens, per cell")
    p.add_argument("--rounds", type=int, default=4, help="matrix: requests each stream sends in a cell")
    p.add_argument("--shared-prefix", type=int, default=2000,
                   help="matrix: a cell per stream count whose prompts share this many tokens, then 64 their own "
                        "(0: no such cells)")
    p.add_argument("--features", action="store_true",
                   help="the cost of a JSON schema on decoding and of prompt log-probabilities on a prefill (above)")
    p.add_argument("--out", help="also write the JSON here (with --matrix, the PNG beside it)")
    args = p.parse_args(argv)
    for flag in ("concurrency", "requests", "max_tokens", "prompt_len", "rounds"):
        if getattr(args, flag) < 1:
            p.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.shared_prefix < 0:
        p.error(f"argument --shared-prefix: must be >= 0, got {args.shared_prefix}")
    if args.matrix and args.features:
        p.error("--matrix and --features are runs of their own: pick one")
    if args.matrix and not args.out:
        p.error("--matrix needs --out (the JSON; the PNG goes beside it)")
    return args


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
    return {"p50": round(at(0.50), 6), "p99": round(at(0.99), 6), "mean": round(statistics.fmean(values), 6)}


async def one_request(http: httpx.AsyncClient, body: dict) -> dict:
    """Send one completion; the arrival times of its token chunks (not streamed: of the whole reply)."""
    start = time.perf_counter()
    arrivals, usage = [], None
    if not body["stream"]:
        r = await http.post("/v1/completions", json=body)
        end = time.perf_counter()
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        return {"start": start, "arrivals": [end], "end": end, "usage": r.json()["usage"]}
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


async def load(http: httpx.AsyncClient, model: str, rng: random.Random, *, concurrency: int, requests: int,
               prompt_len: int, max_tokens: int, vocab_limit: int, prefix: list[int] = (),
               extra: dict | None = None) -> dict:
    """`concurrency` clients send `requests` streamed completions in all: their latencies and throughput. Each
    prompt is `prefix` then random tokens up to prompt_len; `extra`: more fields of every request."""
    prefix = list(prefix)
    bodies = [{"model": model,
               "prompt": prefix + [rng.randrange(1, vocab_limit) for _ in range(prompt_len - len(prefix))],
               "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}, **(extra or {})} for _ in range(requests)]
    pending = iter(bodies)
    results = []

    async def client():
        for body in pending:
            results.append(await one_request(http, body))

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    duration = time.perf_counter() - t0
    done = [r for r in results if "error" not in r]
    errors = sorted({r["error"] for r in results if "error" in r})
    ttft = [r["arrivals"][0] - r["start"] for r in done if r["arrivals"]]
    itl = [b - a for r in done for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    latency = [r["end"] - r["start"] for r in done]
    tokens = sum(r["usage"]["completion_tokens"] if r["usage"] else len(r["arrivals"]) for r in done)
    cached = [(r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") for r in done if r["usage"]]
    cached = [c for c in cached if c is not None]
    return {"concurrency": concurrency, "requests": requests, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "shared_prefix": len(prefix), "cached_tokens_mean": round(statistics.mean(cached), 1) if cached else None,
            "completed": len(done), "failed": len(results) - len(done), "errors": errors[:5],
            "duration_s": round(duration, 3), "ttft_s": percentiles(ttft), "itl_s": percentiles(itl),
            "latency_s": percentiles(latency),
            "request_throughput_per_s": round(len(done) / duration, 3),
            "output_token_throughput_per_s": round(tokens / duration, 2), "output_tokens": tokens}


def connect(args, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=args.url.rstrip("/"), timeout=args.timeout, limits=limits)


async def served_model(http: httpx.AsyncClient, model: str | None) -> str:
    return model or (await http.get("/v1/models")).json()["data"][0]["id"]


async def run(args) -> dict:
    async with connect(args, args.concurrency) as http:
        model = await served_model(http, args.model)
        result = await load(http, model, random.Random(args.seed), concurrency=args.concurrency,
                            requests=args.requests, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                            vocab_limit=args.vocab_limit)
    return {"url": args.url, "model": model, **result}


SUFFIX = 64         # a shared-prefix cell's tokens of each prompt's own


SERVER_SERIES = ("distmk_step_seconds", "distmk_step_rows", "distmk_prefill_seconds",
                 "distmk_time_to_first_token_seconds")


async def server_counters(http: httpx.AsyncClient) -> dict | None:
    """distmk.serve's own sums and counts of step time, step rows, prefill-chunk time and time to first token (GET
    /metrics), or None from a server that does not publish them."""
    from prometheus_client.parser import text_string_to_metric_families
    r = await http.get("/metrics")
    if r.status_code != 200:
        return None
    values = {sample.name: sample.value for family in text_string_to_metric_families(r.text)
              for sample in family.samples if sample.name.endswith(("_sum", "_count"))}
    if not all(f"{name}_count" in values for name in SERVER_SERIES):
        return None
    return values


def server_side(before: dict | None, after: dict | None) -> dict | None:
    """What the server measured during a cell: its engine steps (mean time and rows), prefill chunks, and time to
    first token from a request's arrival (its body not yet read) to its first token's handling on the event loop:
    the client's TTFT less the server's is the request's and the token's way over HTTP."""
    if before is None or after is None:
        return None
    delta = {name: after[name] - before[name] for name in after if name in before}

    def mean(name, scale=1.0):
        count = delta[f"{name}_count"]
        return round(delta[f"{name}_sum"] / count * scale, 3) if count else None
    return {"steps": int(delta["distmk_step_seconds_count"]), "step_ms_mean": mean("distmk_step_seconds", 1e3),
            "rows_mean": mean("distmk_step_rows"), "prefill_chunks": int(delta["distmk_prefill_seconds_count"]),
            "prefill_ms_mean": mean("distmk_prefill_seconds", 1e3),
            "ttft_ms_mean": mean("distmk_time_to_first_token_seconds", 1e3)}


async def run_matrix(args, log) -> dict:
    """Every (streams, prompt length) cell in turn, streams outermost, against one server."""
    rng = random.Random(args.seed)
    async with connect(args, max(args.streams)) as http:
        model = await served_model(http, args.model)
        for prompt_len in args.prompt_lens:               # untimed: first-use costs stay out of the cells
            await load(http, model, rng, concurrency=1, requests=1, prompt_len=prompt_len,
                       max_tokens=min(args.max_tokens, 2), vocab_limit=args.vocab_limit)
        shared = [rng.randrange(1, args.vocab_limit) for _ in range(args.shared_prefix)]
        if shared:                                        # untimed: the prefix's first reading
            await load(http, model, rng, concurrency=1, requests=1, prompt_len=len(shared) + SUFFIX,
                       max_tokens=min(args.max_tokens, 2), vocab_limit=args.vocab_limit, prefix=shared)
        cells = []
        for streams in args.streams:
            runs = [(prompt_len, []) for prompt_len in args.prompt_lens] + ([(len(shared) + SUFFIX, shared)]
                                                                            if shared else [])
            for prompt_len, prefix in runs:
                before, start = await server_counters(http), time.monotonic()
                cell = await load(http, model, rng, concurrency=streams, requests=streams * args.rounds,
                                  prompt_len=prompt_len, max_tokens=args.max_tokens, vocab_limit=args.vocab_limit,
                                  prefix=prefix)
                # the cell's span on the clock of the server's --trace-steps (benchmarks/step_trace.py --matrix)
                cell["monotonic_s"] = [round(start, 6), round(time.monotonic(), 6)]
                cell["server"] = server_side(before, await server_counters(http))
                what = f"{prompt_len}-token prompts" + (f" ({len(prefix)} shared)" if prefix else "")
                log(f"{streams} streams, {what}: TTFT p50 {ms(cell['ttft_s']['p50'])} ms, inter-token p50 "
                    f"{ms(cell['itl_s']['p50'])} ms, {cell['failed']} failed; server: {cell['server']}")
                cells.append(cell)
    return {"url": args.url, "model": model, "max_tokens": args.max_tokens, "streams": args.streams,
            "prompt_lens": args.prompt_lens, "shared_prefix": args.shared_prefix, "rounds": args.rounds, "cells": cells,
            "failed": sum(cell["failed"] for cell in cells),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", *sys.argv])}


# a schema every reply can keep to for as long as it is allowed to run
ARRAY_OF_STRINGS = {"type": "json_schema", "json_schema": {"name": "items", "strict": True, "schema": {
    "type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"],
    "additionalProperties": False}}}
WHOLE = {"stream": False, "stream_options": None}       # a reply in one piece
# name: (the cell's request fields, the plain cell's, prompt length (None: --prompt-lens' longest), max_tokens of the
# cell and of the plain cell (None: --max-tokens for both), what is compared)
FEATURES = {
    "json_schema": ({"response_format": ARRAY_OF_STRINGS}, {}, 256, None, "itl_s"),
    "prompt_logprobs": ({"echo": True, "logprobs": 1, **WHOLE}, WHOLE, None, (0, 1), "latency_s"),
}


async def run_features(args, log) -> dict:
    """Each of FEATURES' cells beside the same requests without the feature, one stream, against one server."""
    rng = random.Random(args.seed)
    features = []
    async with connect(args, 1) as http:
        model = await served_model(http, args.model)
        for name, (fields, plain_fields, prompt_len, max_tokens, key) in FEATURES.items():
            prompt_len = prompt_len or max(args.prompt_lens)
            with_tokens, plain_tokens = max_tokens or (args.max_tokens, args.max_tokens)
            cells = {}
            for which, extra, tokens in (("plain", plain_fields, plain_tokens), ("with", fields, with_tokens)):
                await load(http, model, rng, concurrency=1, requests=1, prompt_len=prompt_len,  # untimed
                           max_tokens=tokens, vocab_limit=args.vocab_limit, extra=extra)
                cells[which] = await load(http, model, rng, concurrency=1, requests=args.rounds,
                                          prompt_len=prompt_len, max_tokens=tokens, vocab_limit=args.vocab_limit,
                                          extra=extra)
            plain, with_ = cells["plain"][key]["p50"], cells["with"][key]["p50"]
            ratio = round(with_ / plain, 3) if plain and with_ else None
            log(f"{name}: {key[:-2]} p50 {ms(with_)} ms against {ms(plain)} without ({ratio}x), output tokens "
                f"{cells['with']['output_tokens']} against {cells['plain']['output_tokens']}, "
                f"{cells['with']['failed'] + cells['plain']['failed']} failed")
            features.append({"feature": name, "fields": fields, "compared": key, "ratio_p50": ratio, **cells})
    return {"url": args.url, "model": model, "rounds": args.rounds, "features": features,
            "failed": sum(f[c]["failed"] for f in features for c in ("plain", "with")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["python", *sys.argv])}


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def plot_matrix(matrix: dict, path: str) -> None:
    """TTFT and inter-token latency (p50 solid, p99 dashed) against prompt length, a line per stream count."""
    import matplotlib
    matplotlib.use("Agg")                 # files only, no display
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "itl_s", "inter-token latency")):
        for streams in matrix["streams"]:
            cells = [c for c in matrix["cells"] if c["concurrency"] == streams and c[key]["p50"] is not None
                     and not c.get("shared_prefix")]
            lens, name = [c["prompt_len"] for c in cells], f"{streams} stream{'s' if streams > 1 else ''}"
            line, = ax.plot(lens, [c[key]["p50"] * 1e3 for c in cells], "o-", label=f"{name}, p50")
            ax.plot(lens, [c[key]["p99"] * 1e3 for c in cells], "--", color=line.get_color(), alpha=0.6,
                    label=f"{name}, p99")
        ax.set(xlabel="prompt tokens", ylabel="ms", title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{matrix['model']}: {matrix['max_tokens']} tokens out per request")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(f"[serve_load] {msg}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(run_matrix(args, log) if args.matrix else run_features(args, log) if args.features
                             else run(args))
    except httpx.TransportError as e:
        print(f"error: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    if args.out:
        write_json(result, args.out)
    if args.matrix:
        png = os.path.splitext(args.out)[0] + ".png"
        try:
            plot_matrix(result, png)
        except ImportError:
            print(f"error: the PNG needs matplotlib (pip install -e '.[bench]'); {args.out} is written", file=sys.stderr)
            return 1
        log(f"wrote {args.out} and {png}")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
