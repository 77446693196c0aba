"""How the server's ranks run the engine together: rank 0 plans every step (its batcher holds all the
sequences) and broadcasts the plan; every rank, rank 0 included, then runs the same step, whose
tensor-parallel exchanges need all of them. Only rank 0 looks at the results and samples.

Messages travel on a gloo process group of their own: an idle server is every other rank waiting in a
broadcast, which sleeps in gloo instead of spinning. Rank 0 sends something at least every few seconds
(steps, or heartbeats while idle), so a follower that hears nothing for CONTROL_TIMEOUT knows rank 0 is
gone, even when no connection reset tells it; and rank 0 notices a dead rank while idle, without
waiting for the next request. A message is a header [op, rows, block-table width, needs_logits, steps] and,
for a step, an int64 [rows, 2 + width] tensor: token, position and block table of each row; for a prefill
chunk the header is [PREFILL, tokens, blocks, start, logits + 2 x last] and the tensor the chunk's tokens, then
its sequence's blocks.
"""
from __future__ import annotations

import datetime

import torch

from distmk.comm.cpu import PeerFailed, ThreadRanks
from distmk.errors import DistmkError
from distmk.runtime.batcher import PrefillInputs, StepInputs, run_prefill, run_step
from distmk.runtime.engine import pack_rows

STEP, HEARTBEAT, SHUTDOWN, PREFILL = 1, 2, 3, 4
CONTROL_TIMEOUT = datetime.timedelta(seconds=120)   # >> the scheduler's HEARTBEAT_S and one warm-up step


class RankLost(DistmkError):
    """A tensor-parallel rank stopped answering: the job cannot step any more."""


def on_engine_device(engine) -> None:
    """Make the engine's GPU and stream current on the calling thread (a thread starts on GPU 0 and its default
    stream whatever the main thread chose), so that steps run from a thread launch their kernels on the right
    device, and virtual ranks' on their own streams (comm/cpu.py run_simulated_ranks)."""
    if engine.device.type == "cuda":
        torch.cuda.set_device(engine.device)
        torch.cuda.set_stream(engine.stream)


def control_group(comm):
    """The group the plans travel on: a gloo group of its own (every rank must create it, in the same order), or
    virtual ranks' communicator itself (threads of one process: comm/cpu.py ThreadRanks)."""
    import torch.distributed as dist
    if isinstance(comm, ThreadRanks):
        return comm
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


def _broadcast(t: torch.Tensor, group) -> None:
    import torch.distributed as dist
    if isinstance(group, ThreadRanks):
        try:
            return group.broadcast(t)
        except PeerFailed as e:
            raise RankLost(str(e)) from e
    try:
        dist.broadcast(t, src=0, group=group)
    except RuntimeError as e:            # gloo reports a closed or reset peer connection as RuntimeError
        raise RankLost(f"lost contact with another rank ({str(e).splitlines()[0]})") from e


class Leader:
    """Rank 0's side: each step goes to the other ranks, then runs here. group=None: a single rank."""

    def __init__(self, engine, group=None):
        self.engine, self.group = engine, group

    def run(self, step: StepInputs) -> tuple[list[list[int]], torch.Tensor | None]:
        if self.group is not None:
            width = max(len(blocks) for blocks in step.block_tables)
            self._send(STEP, len(step.tokens), width, step.needs_logits, step.steps)
            rows = pack_rows(step.tokens, step.positions, step.block_tables, width)
            _broadcast(torch.from_numpy(rows), self.group)
            return _with_peers(run_step, self.engine, step)
        return run_step(self.engine, step)

    def prefill(self, chunk: PrefillInputs):
        if self.group is not None:
            self._send(PREFILL, len(chunk.tokens), len(chunk.blocks), chunk.start, int(chunk.logits) + 2 * chunk.last)
            _broadcast(torch.tensor(chunk.tokens + chunk.blocks, dtype=torch.int64), self.group)
        return _with_peers(run_prefill, self.engine, chunk)

    def heartbeat(self) -> None:
        if self.group is not None:
            self._send(HEARTBEAT)

    def shutdown(self) -> None:
        if self.group is not None:
            self._send(SHUTDOWN)

    def _send(self, op: int, rows: int = 0, width: int = 0, flag: int = 0, steps: int = 0) -> None:
        _broadcast(torch.tensor([op, rows, width, int(flag), steps], dtype=torch.int64), self.group)


def follow(engine, group) -> None:
    """A rank other than 0: run every step rank 0 sends, until it sends the shutdown."""
    on_engine_device(engine)
    header = torch.zeros(5, dtype=torch.int64)
    while True:
        _broadcast(header, group)
        op, n, width, flag, steps = header.tolist()
        if op == SHUTDOWN:
            return
        if op == HEARTBEAT:
            continue
        if op == PREFILL:
            chunk = torch.empty(n + width, dtype=torch.int64)
            _broadcast(chunk, group)
            _with_peers(run_prefill, engine, PrefillInputs(chunk[:n].tolist(), flag, chunk[n:].tolist(),
                                                           bool(steps & 1), bool(steps & 2)))
            continue
        rows = torch.empty(n, 2 + width, dtype=torch.int64)
        _broadcast(rows, group)
        _with_peers(run_step, engine, StepInputs(rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2:].tolist(),
                                                 bool(flag), steps))


def _with_peers(run, engine, inputs):
    """run(engine, inputs): a step or a prefill chunk, whose exchanges need every rank."""
    try:
        return run(engine, inputs)
    except RuntimeError as e:            # the step's own exchanges fail like this when a peer is gone
        raise RankLost(f"a tensor-parallel step failed ({str(e).splitlines()[0]})") from e
