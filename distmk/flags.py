"""The argparse types that check a flag's range, so that every program (generate, serve, `python -m distmk.graph`,
the benchmarks) refuses an out-of-range value in one line naming the flag."""
from __future__ import annotations

import argparse
import math


def int_in(lo: int, hi: int | None = None):
    """An argparse type: an integer in lo..hi (no upper bound when hi is None)."""
    wanted = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {value}")
        return value
    return parse


def float_in(lo: float, hi: float = math.inf, lo_open: bool = False):
    """An argparse type: a finite number in [lo, hi], or (lo, hi] when lo_open; NaN and inf are refused."""
    wanted = f"a finite number {'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if not (math.isfinite(value) and (value > lo if lo_open else value >= lo) and value <= hi):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        return value
    return parse


COUNT = int_in(1)                  # how many of something: at least one
NON_NEGATIVE = int_in(0)
SEED = int_in(0, 2 ** 32 - 1)
PROBABILITY = float_in(0, 1, lo_open=True)
