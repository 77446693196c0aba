"""Decode step → task graph → scheduled task table."""
from distmk.graph.lowering import GraphConfig, compile_step
from distmk.graph.table import TaskTable

__all__ = ["GraphConfig", "TaskTable", "compile_step"]
