"""The tensor-parallel process group and the time spent in its collectives.

Every collective of the engine goes through `all_reduce` here so that the
time a rank spends communicating (which includes waiting for slower peers)
is measured in one place; compute time is the step's wall time minus it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommClock:
    """Seconds spent inside collectives since the process started."""

    seconds: float = 0.0
    calls: int = 0


CLOCK = CommClock()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In-place all-reduce, timed; a no-op without a process group of size > 1."""
    if world_size(group) == 1:
        return tensor
    start = time.perf_counter()
    dist.all_reduce(tensor, op=op, group=group)
    CLOCK.seconds += time.perf_counter() - start
    CLOCK.calls += 1
    return tensor
