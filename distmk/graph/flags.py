"""GraphConfig's command-line flags: one declaration for generate, serve and `python -m distmk.graph`."""
from __future__ import annotations

import argparse
import dataclasses

from distmk.flags import COUNT, NON_NEGATIVE
from distmk.graph.lowering import GraphConfig


def add_graph_args(p: argparse.ArgumentParser, workers_default: str) -> None:
    """GraphConfig's tiling flags (their help is the fields'), and --workers (`workers_default` says what its
    default is)."""
    for f in dataclasses.fields(GraphConfig):
        if "help" in f.metadata:
            p.add_argument("--" + f.name.replace("_", "-"), type=NON_NEGATIVE, default=f.default,
                           help=f.metadata["help"])
    p.add_argument("--workers", type=COUNT, default=None,
                   help=f"worker queues (default: {workers_default})")


def tiling_of(args) -> dict:
    """The GraphConfig fields that add_graph_args' tiling flags set."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(GraphConfig) if "help" in f.metadata}


def graph_config(args, **fields) -> GraphConfig:
    """The GraphConfig of add_graph_args' flags, with `fields` (batch, workers, context) on top."""
    return GraphConfig(**tiling_of(args), **fields)
