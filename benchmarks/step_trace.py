"""Summarise a server's step timeline (python -m distmk.serve --trace-steps FILE): what ran between two
consecutive tokens of a stream. Each gap a stream saw (its inter-token latency, on the server) is split into
the engine launches, the prefill chunks and the rest (the host: scheduling, sampling, handing tokens over),
and the gaps are grouped by whether a prefill chunk ran in them. Each request's time to its first token (from its
arrival to the token's hand-over; its delivery on the event loop and HTTP's after it are not in the trace) is
split alike, after its admission (reading and checking the request, to its hand-over to the scheduler) and its
queue (to the scheduler's taking it in, between two steps).

    python benchmarks/step_trace.py FILE [--matrix SERVE_MATRIX_JSON] [--json OUT]

Prints, for gaps without and with prefill chunks: their count and share, p50 and p99 of the gap and of each
part; the same for first tokens; then each prefill chunk size's median time. --matrix: the same for each cell of a
serve_load.py --matrix run against that server, from the span of the server's clock it recorded (time.monotonic,
one clock for every process of a machine). --json writes the same."""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import statistics
import sys

from serve_load import percentiles

PARTS = ("gap", "launch", "prefill", "host")
FIRST_PARTS = ("ttft", "admission", "queue", "launch", "prefill", "host")


def ms_percentiles(values: list[float]) -> dict:
    """p50 and p99 of seconds, in ms, by the rule serve_load.py gives the client's inter-token latency."""
    p = percentiles(values)
    return {q: None if p[q] is None else round(p[q] * 1e3, 3) for q in ("p50", "p99")}


def summarise(records: list[dict]) -> dict:
    spans = sorted((r for r in records if "start" in r), key=lambda r: r["start"])
    ends = [r["end"] for r in spans]

    def inside(since: float, until: float) -> dict:
        """Seconds of launches and of prefill chunks that ended in (since, until]."""
        ran = spans[bisect.bisect_right(ends, since):bisect.bisect_right(ends, until)]
        return {kind: sum(s["end"] - s["start"] for s in ran if s["kind"] == kind) for kind in ("step", "prefill")}

    gaps = {"no prefill": [], "prefill": []}
    last_seen: dict[int, float] = {}
    first_token: dict[int, float] = {}
    for r in (r for r in records if r["kind"] == "tokens"):
        for seq, n in collections.Counter(r["ids"]).items():
            if seq in last_seen:
                since = last_seen[seq]
                parts = inside(since, r["time"])
                gap = r["time"] - since
                gaps["prefill" if parts["prefill"] else "no prefill"].append(
                    {"gap": gap / n, "launch": parts["step"] / n, "prefill": parts["prefill"],
                     "host": (gap - parts["step"] - parts["prefill"]) / n})
            else:
                first_token[seq] = r["time"]
            last_seen[seq] = r["time"]
    first = []
    for r in (r for r in records if r["kind"] == "request" and r["id"] in first_token):
        until = first_token[r["id"]]
        parts = inside(r["time"], until)
        first.append({"ttft": until - r["arrived"], "admission": r["submitted"] - r["arrived"],
                      "queue": r["time"] - r["submitted"], "launch": parts["step"], "prefill": parts["prefill"],
                      "host": until - r["time"] - parts["step"] - parts["prefill"]})

    total = sum(len(g) for g in gaps.values())
    every = ms_percentiles([g["gap"] for v in gaps.values() for g in v])
    out = {"launches": sum(r["kind"] == "step" for r in records),
           "prefill_chunks": sum(r["kind"] == "prefill" for r in records),
           "gap_ms_p50": every["p50"], "gap_ms_p99": every["p99"], "gaps": {}}
    for name, g in gaps.items():
        out["gaps"][name] = {"count": len(g), "share": round(len(g) / total, 4) if total else None,
                             **{f"{part}_ms_{q}": value for part in PARTS
                                for q, value in ms_percentiles([x[part] for x in g]).items()}}
    out["first_token"] = {"count": len(first), **{f"{part}_ms_{q}": value for part in FIRST_PARTS
                                                  for q, value in ms_percentiles([x[part] for x in first]).items()}}
    sizes: dict[int, list[float]] = {}
    for r in spans:
        if r["kind"] == "prefill":
            sizes.setdefault(r["rows"], []).append(r["end"] - r["start"])
    out["prefill_ms_median_by_tokens"] = {n: round(statistics.median(t) * 1e3, 3) for n, t in sorted(sizes.items())}
    return out


def in_window(records: list[dict], start: float, end: float) -> list[dict]:
    return [r for r in records if start <= r.get("time", r.get("start")) <= end]


def report(out: dict, title: str) -> None:
    print(f"{title}: {out['launches']} launches, {out['prefill_chunks']} prefill chunks; inter-token gaps p50 "
          f"{out['gap_ms_p50']} ms, p99 {out['gap_ms_p99']} ms")
    for name, g in out["gaps"].items():
        if g["count"]:
            print(f"  {name:10s} {g['count']:6d} gaps ({g['share']:.1%}): " + " | ".join(
                f"{part} p50 {g[f'{part}_ms_p50']} p99 {g[f'{part}_ms_p99']}" for part in PARTS) + " ms")
    g = out["first_token"]
    if g["count"]:
        print(f"  first token {g['count']:5d} requests: " + " | ".join(
            f"{part} p50 {g[f'{part}_ms_p50']} p99 {g[f'{part}_ms_p99']}" for part in FIRST_PARTS) + " ms")
    print("  prefill chunk ms (median) by tokens:", out["prefill_ms_median_by_tokens"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file")
    p.add_argument("--matrix", metavar="JSON", help="serve_load.py --matrix output: a summary per cell")
    p.add_argument("--json", metavar="OUT", help="also write the summary here")
    args = p.parse_args(argv)
    try:
        with open(args.file) as f:
            records = [json.loads(line) for line in f if line.strip()]
        cells = json.load(open(args.matrix))["cells"] if args.matrix else []
    except (OSError, ValueError, KeyError) as e:
        print(f"step_trace.py: cannot read {args.file}{' or ' + args.matrix if args.matrix else ''}: {e!r}",
              file=sys.stderr)
        return 1
    out = summarise(records)
    report(out, args.file)
    if cells:
        out["cells"] = []
        for cell in cells:
            if "monotonic_s" not in cell:
                print(f"step_trace.py: {args.matrix} has no cell spans (serve_load.py before they were kept)",
                      file=sys.stderr)
                return 1
            summary = {"streams": cell["concurrency"], "prompt_len": cell["prompt_len"],
                       **summarise(in_window(records, *cell["monotonic_s"]))}
            report(summary, f"{summary['streams']} streams x {summary['prompt_len']}-token prompts")
            out["cells"].append(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
