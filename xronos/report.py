"""The run report (DESIGN.md contract) and the pure arithmetic of idle time.

Idle time of a device in a step = (slowest device's compute time) - (its own
compute time); compute time = the step's wall time on that device minus the
time it spent inside collectives. Idle ratio = idle / step time, where the
step time is the wall time of the slowest device. The first step (warm-up:
allocations, first-touch of memory) is not measured when there are more.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from xronos.splits import ShardSplit


class RankResult(BaseModel):
    """What one worker measured, written by the worker at the end of a job."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    losses: list[float]
    step_seconds: list[float]
    comm_seconds: list[float]
    param_bytes: int
    peak_rss_bytes: int


class NodeReport(BaseModel):
    rank: int
    speed: float | None
    kv_groups: int
    mlp_columns: int
    vocab_rows: int
    compute_seconds: float
    comm_seconds: float
    idle_seconds: float
    idle_ratio: float
    param_bytes: int
    peak_rss_bytes: int


class RunReport(BaseModel):
    mode: str
    world_size: int
    split: ShardSplit
    losses: list[float]
    step_seconds: list[float]
    measured_steps: int
    mean_step_seconds: float
    idle_ratio: float
    nodes: list[NodeReport]


def measured_range(n_steps: int) -> range:
    """Steps that count for timing: all but the first, when there are more."""
    return range(1 if n_steps > 1 else 0, n_steps)


def build_report(mode: str, split: ShardSplit, speeds: list[float | None], results: list[RankResult]) -> RunReport:
    """Combine the workers' results into the report; totals are over measured steps."""
    results = sorted(results, key=lambda r: r.rank)
    n = len(results[0].step_seconds)
    steps = measured_range(n)
    step_seconds = [max(r.step_seconds[k] for r in results) for k in range(n)]
    compute = [[r.step_seconds[k] - r.comm_seconds[k] for k in range(n)] for r in results]
    slowest = [max(c[k] for c in compute) for k in range(n)]
    nodes = []
    for r, c in zip(results, compute):
        idle = [slowest[k] - c[k] for k in steps]
        nodes.append(
            NodeReport(
                rank=r.rank,
                speed=speeds[r.rank],
                kv_groups=split.kv_groups[r.rank],
                mlp_columns=split.mlp_columns[r.rank],
                vocab_rows=split.vocab_rows[r.rank],
                compute_seconds=sum(c[k] for k in steps),
                comm_seconds=sum(r.comm_seconds[k] for k in steps),
                idle_seconds=sum(idle),
                idle_ratio=sum(i / step_seconds[k] for i, k in zip(idle, steps)) / len(steps),
                param_bytes=r.param_bytes,
                peak_rss_bytes=r.peak_rss_bytes,
            )
        )
    return RunReport(
        mode=mode,
        world_size=len(results),
        split=split,
        losses=results[0].losses,
        step_seconds=step_seconds,
        measured_steps=len(steps),
        mean_step_seconds=sum(step_seconds[k] for k in steps) / len(steps),
        idle_ratio=sum(node.idle_ratio for node in nodes) / len(nodes),
        nodes=nodes,
    )
