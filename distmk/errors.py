"""Errors distmk raises on bad input: each message names what is wrong and what would be accepted."""


class DistmkError(Exception):
    """Base class of distmk's user-facing errors."""


class ModelError(DistmkError):
    """An unsupported architecture, an unknown preset or a broken checkpoint."""


class ShardingError(DistmkError):
    """A tensor-parallel degree the model's shapes cannot be split by."""


class GraphError(DistmkError):
    """A task graph or schedule that breaks an invariant (cycle, missing producer, deadlock)."""
