"""The task table: the one format every executor reads (the CPU reference now, the GPU kernel verbatim).

tasks      int32 [T, 8]  columns TYPE, LAYER, A0..A3, WAIT, SIGNAL (see COLUMNS); -1 = no event
event_need int32 [E]     signals per step that complete an event. Counters are never reset: in step
                         `epoch` (1, 2, ...) a task may start once counter[WAIT] >= epoch * event_need[WAIT].
queue_ptr  int32 [W+1]   worker w runs queue[queue_ptr[w]:queue_ptr[w+1]] in order
queue      int32 [T]     task ids
cost       int64 [T]     bytes each task moves (the scheduler's estimate)
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

COLUMNS = ("type", "layer", "a0", "a1", "a2", "a3", "wait", "signal")
TYPE, LAYER, A0, A1, A2, A3, WAIT, SIGNAL = range(len(COLUMNS))


@dataclass
class TaskTable:
    tasks: torch.Tensor
    event_need: torch.Tensor
    queue_ptr: torch.Tensor
    queue: torch.Tensor
    cost: torch.Tensor
    event_names: list[str] = field(default_factory=list)
    config: object = None       # the GraphConfig it was compiled for
    tp: int = 1                 # ranks running the same table (an exchange's event needs one signal from each)
    schedule: dict = field(default_factory=dict)   # scheduler's estimates (makespan, critical path, ...)

    @property
    def num_tasks(self) -> int:
        return self.tasks.shape[0]

    @property
    def num_workers(self) -> int:
        return self.queue_ptr.shape[0] - 1

    def digest(self) -> int:
        """crc32 of the tasks and their events: equal tables (every tensor-parallel rank's) give equal digests."""
        return zlib.crc32(self.tasks.cpu().numpy().tobytes() + self.event_need.cpu().numpy().tobytes())

    def worker_queue(self, w: int) -> list[int]:
        return self.queue[self.queue_ptr[w]:self.queue_ptr[w + 1]].tolist()

    def to(self, device) -> "TaskTable":
        """The same table with its int tensors on `device` (for the GPU kernel)."""
        moved = {k: getattr(self, k).to(device) for k in ("tasks", "event_need", "queue_ptr", "queue", "cost")}
        return TaskTable(**moved, event_names=self.event_names, config=self.config, tp=self.tp,
                         schedule=self.schedule)
