"""The run report (docs/command-line.md) and the pure arithmetic of idle time.

Idle time of a device in a step = (slowest device's compute time) - (its own
compute time); compute time = the step's wall time on that device minus the
time it spent inside collectives. Idle ratio = idle / step time, where the
step time is the wall time of the slowest device. The first WARMUP_STEPS
steps (allocations, first touch of memory, the heap growing to its working
size) are not measured when there are more.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from xronos.contract.choice import LayoutChoice
from xronos.contract.profiles import DeviceProfile
from xronos.contract.splits import ModelDims, ShardSplit


class ReplanCheck(BaseModel):
    """One re-plan check of mode xronos: the measured pace against the profiles' prediction, and the outcome.

    Recorded because a re-shard changes what the report measures (only the last split's
    steps count): the trace says when and why the split moved, or why it stayed.
    """

    model_config = ConfigDict(extra="forbid")

    after_step: int
    """The check ran after this many steps."""
    measured_compute_seconds: list[float]
    """Per rank: mean compute seconds per step over the split's timed steps so far (a job's first checks)
    or over its last few (`edge_node.trainer.DRIFT_WINDOW`: the later checks, which re-plan on drift)."""
    measured_segment_seconds: list[tuple[float, float, float]] | None = None
    """Per rank: of that compute, the seconds in the attention and the MLP segments of all layers, and in
    the vocabulary segment (the rest: embedding, AdamW)."""
    predicted_compute_seconds: list[float]
    """Per rank: what the plan's profiles, as recalibrated by the earlier checks, predicted per step."""
    new_split: ShardSplit | None = None
    """The split it re-sharded to; None: the split was kept (gain under the threshold)."""
    predicted_gain: float | None = None
    """How much shorter the best split's step is than the current one's, by the recalibrated profiles."""
    reshard_seconds: float | None = None
    """What the re-shard took (checkpoint, reload, optimizer state), when it re-sharded."""
    predicted_step_seconds: float | None = None
    """The step the recalibrated profiles predict for the split the job runs on after this check: the cost
    model's prediction with the devices' paces as the job measured them, where the plan's prediction has their
    paces as profiled (under an emulated CPU quota the two differ by up to ~1.3x: docs/benchmarks.md)."""

    def drift(self) -> list[float]:
        """Per rank: measured / predicted compute (1.0 where either is missing)."""
        return [
            m / p if m > 0 and p > 0 else 1.0
            for m, p in zip(self.measured_compute_seconds, self.predicted_compute_seconds)
        ]


DRIFT_THRESHOLD = 0.10
"""A device drifts from the plan when its compute in every step a check measures is over 10% above (or
below) what the profiles, as the job's checks recalibrated them, predict for its share: then the check
re-plans (`edge_node.trainer.DRIFT_WINDOW`). A device that loses a quarter of its CPU computes a third
slower; a single step varies by ~15% under CPU quotas on shared cores, but four in a row rarely all
beyond 10% the same way."""


def drifted(ratio: float) -> bool:
    """Whether a measured / predicted compute ratio is beyond DRIFT_THRESHOLD, either way (a device
    that slowed down, or one that got its CPU back)."""
    return max(ratio, 1 / ratio) > 1 + DRIFT_THRESHOLD if ratio > 0 else False


class CollectiveChoice(BaseModel):
    """How a tensor-parallel job's ranks all-reduced (`edge_node.tp.comm`), and what `auto` measured to choose."""

    algorithm: Literal["ring", "hub"]
    hub_rank: int | None = None
    hub_sockets: bool | None = None
    """Through the hub: whether its messages went over its own sockets (False: they could not be opened,
    and went through gloo's)."""
    ring_seconds: float | None = None
    """Collective `auto`: one all-reduce of an activation by gloo's ring (the slowest rank's median)."""
    hub_seconds: float | None = None
    """Collective `auto`: the same through the hub."""

    def label(self) -> str:
        """'ring' or 'hub@R'."""
        return self.algorithm if self.hub_rank is None else f"hub@{self.hub_rank}"

    def describe(self) -> str:
        measured = (
            f" (auto: ring {self.ring_seconds * 1e3:.1f} ms, hub {self.hub_seconds * 1e3:.1f} ms per activation)"
            if self.ring_seconds is not None and self.hub_seconds is not None
            else ""
        )
        through = "by the ring" if self.hub_rank is None else f"through rank {self.hub_rank}"
        gloo = " (over gloo's messages: its sockets could not be opened)" if self.hub_sockets is False else ""
        return f"all-reduce {through}{gloo}{measured}"


TIMELINE_EVENTS = (
    "imports",
    "profiled",
    "plan_received",
    "handoff",
    "process_group",
    "model_loaded",
    "collective_chosen",
    "barrier",
    "first_step",
    "second_step",
    "reshard",
    "last_step",
    "saved",
)
"""A worker's timeline events, in the order they occur (`TimelineEvent`)."""


class TimelineEvent(BaseModel):
    """A start-up phase (or a re-shard) of one worker ending: `at_seconds` after its process started.

    Names, in the order they occur: `imports`, `profiled` and `plan_received` (profiled modes), `handoff`
    (with its `seconds`: a head start's device, which trains its first steps instead of profiling, then
    marks the phases below again), `process_group`, `model_loaded`, `collective_chosen` (TP modes on more
    than one rank), `barrier`, `first_step`, `second_step`, `reshard` (each, with its `seconds`),
    `last_step`, `saved`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    at_seconds: float
    seconds: float | None = None
    """How long the phase took, where it is not simply the time since the previous event (a re-shard)."""


class RankResult(BaseModel):
    """What one worker measured, written by the worker at the end of a job."""

    model_config = ConfigDict(extra="forbid")

    rank: int
    losses: list[float]
    step_seconds: list[float]
    comm_seconds: list[float]
    param_bytes: int
    peak_rss_bytes: int
    measure_from: int = 0
    """Index into step_seconds of the first step that counts (after warm-up and any re-plan)."""
    split: ShardSplit | None = None
    """The split this rank ended with (a re-plan may change it)."""
    replans: list[ReplanCheck] = []
    segment_seconds: list[tuple[float, float, float]] = []
    """Tensor-parallel modes, per step: compute in the attention and MLP segments of all layers and in the
    vocabulary segment (`edge_node.tp.comm`)."""
    collective: CollectiveChoice | None = None
    """Tensor-parallel modes on more than one rank."""
    started_at: float | None = None
    """When the worker process started (Unix time), the origin of its `timeline`."""
    timeline: list[TimelineEvent] = []
    """When the worker's start-up phases, first steps, re-shards, last step and save ended."""


class HeadStart(BaseModel):
    """Mode xronos run locally: the fastest device trained alone from the job's first step while the others
    profiled, and handed its model over at a step boundary once the plan was made (`edge_node.head_start`).

    Its worker rewrites this after every step (the launcher plans with its pace); the report keeps the last.
    """

    model_config = ConfigDict(extra="forbid")

    device: int
    steps: int
    """Steps it trained alone (in this run: after a resumed checkpoint's): up to the handoff, or to the job's end."""
    compute_seconds: list[float]
    """The compute seconds (wall less the time in collectives) of its first steps (at most ten)."""
    checkpoint: str | None = None
    """The checkpoint it handed over through, in the run's own directory (None: no handoff)."""
    handoff_seconds: float | None = None
    """Seconds the handoff checkpoint took to write."""
    finished: bool = False
    """It trained the whole job (the plan kept it alone, or the job ended before any plan)."""
    given_up: bool = False
    """The others' profiles were in before it had a steady step to be priced by (its steps too long for a head
    start to pay): its worker was stopped, and the device started afresh with the plan, as every member did."""


class ExcludedDevice(BaseModel):
    device: int
    name: str | None = None
    """The node id, in a job run through the controller."""
    speed: float | None
    reason: str


class NodeReport(BaseModel):
    rank: int
    device: int
    name: str | None = None
    """The node id, in a job run through the controller."""
    speed: float | None
    layers: tuple[int, int] | None = None
    kv_groups: int
    kv_rows: tuple[int, int] | None = None
    """Rows of each micro-batch this rank computes its KV group for, when ranks share the group."""
    mlp_columns: int
    vocab_rows: int
    compute_seconds: float
    comm_seconds: float
    idle_seconds: float
    idle_ratio: float
    param_bytes: int
    peak_rss_bytes: int
    predicted_compute_seconds: float | None = None
    segment_wait_seconds: float | None = None
    """Tensor-parallel modes: per step, the sum over the attention, MLP and vocabulary segments of the
    slowest device's compute in that segment minus its own (summed over the layers first, so a lower
    bound): waiting at the segments' all-reduces that the step-level idle does not see (a device
    idle in one segment and the slowest in another), counted in its communication."""
    segment_seconds: tuple[float, float, float] | None = None
    """Tensor-parallel modes on more than one rank: of `compute_seconds`, the seconds in the attention and
    MLP segments of all layers and in the vocabulary segment (the rest: embedding, AdamW, the framework)."""
    started_at: float | None = None
    """When the device's worker process started (Unix time), the origin of its `timeline`."""
    timeline: list[TimelineEvent] = []
    """When the worker's start-up phases, first steps, re-shards, last step and save ended (`RankResult`)."""


class RunReport(BaseModel):
    mode: str
    world_size: int
    split: ShardSplit | None
    stages: list[tuple[int, int]] | None = None
    losses: list[float]
    step_seconds: list[float]
    series_every: int = 1
    """`losses` and `step_seconds` hold every this-many-th step (and always the last one): 1 but in a job
    whose report would not fit in one MQTT message (`thin_series`). The other fields are computed from
    every step; the whole series stay in each node's job directory (`result.json`)."""
    measured_steps: int
    mean_step_seconds: float
    idle_ratio: float
    nodes: list[NodeReport]
    predicted_step_seconds: float | None = None
    predicted_idle_ratio: float | None = None
    """Mode xronos: the idle ratio its plan predicted, for the split it started with (before any re-plan)."""
    excluded: list[ExcludedDevice] = []
    replans: list[ReplanCheck] = []
    """Mode xronos: every re-plan check, in order (a resumed job's too: checkpoints keep them)."""
    collective: CollectiveChoice | None = None
    """Tensor-parallel modes on more than one rank: the all-reduce the ranks used."""
    profiles: list[DeviceProfile] = []
    """Runs that were profiled (xronos and pp locally; every mode a controller plans): every
    device's profile the plan was made from, in device order (left-out devices too), so that
    `xronos plan --profiles REPORT` re-derives a xronos plan and its predictions without hunting
    for them in the profile cache."""
    job_seconds: float | None = None
    """`xronos run` and the bench: wall seconds from the launcher's start to the saved model and every worker's
    end (checks, worker start-up, profiling, planning, training, the save), the command's own imports aside."""
    layout_choice: LayoutChoice | None = None
    """Mode xronos: the layouts its planner priced by the job's predicted time, the chosen one first."""
    head_start: HeadStart | None = None
    """Mode xronos run locally: the steps its fastest device trained alone while the others profiled."""


WARMUP_STEPS = 2
"""Steps at the start of a job that are not timed. Measured here in every mode: the
first step allocates (AdamW's moments too) and the second still runs ~1.5x a steady one."""


def thin_series(report: RunReport, every: int) -> RunReport:
    """The report with its per-step series kept at every `every`-th step and the last (the aggregates,
    computed from every step, stay as they are)."""
    if every <= 1:
        return report

    def thin(series: list[float]) -> list[float]:
        kept = series[::every]
        return kept + series[-1:] if (len(series) - 1) % every else kept

    return report.model_copy(
        update={"losses": thin(report.losses), "step_seconds": thin(report.step_seconds), "series_every": every}
    )


def idle_seconds(compute: list[float]) -> list[float]:
    """Each device's idle in a step (measured or predicted): the slowest device's compute minus its own."""
    slowest = max(compute)
    return [slowest - c for c in compute]


def mean_idle_ratio(compute: list[float], step: float) -> float:
    """The devices' mean idle over one step of `step` seconds, from each device's compute in it
    (a plan's prediction: a run's measured idle ratio is taken step by step)."""
    return sum(idle_seconds(compute)) / len(compute) / step if step > 0 and compute else 0.0


def segment_wait_seconds(segments: list[tuple[float, ...]]) -> list[float]:
    """Each device's wait at the segments' ends in one step, from every device's compute per segment."""
    slowest = [max(column) for column in zip(*segments)]
    return [sum(m - x for m, x in zip(slowest, mine)) for mine in segments]


def measured_range(n_steps: int, start: int = 0) -> range:
    """Steps that count for timing: from `start`, never the warm-up steps, and at least the last one."""
    start = max(start, WARMUP_STEPS)
    return range(max(0, min(start, n_steps - 1)), n_steps)


def describe_layout(split: ShardSplit | None, stages: list[tuple[int, int]] | None) -> str:
    if split is not None:
        return split.describe()
    return "layers " + "/".join(f"{lo}-{hi}" for lo, hi in stages or [])


def _pipeline_shares(stages: list[tuple[int, int]], dims: ModelDims) -> list[tuple[int, int, int]]:
    """What a stage holds, in TP terms: all groups and columns of its layers; the head holds the vocabulary."""
    last = len(stages) - 1
    return [
        (
            dims.num_kv_heads if hi > lo else 0,
            dims.intermediate_size if hi > lo else 0,
            dims.vocab_size if r == last else 0,
        )
        for r, (lo, hi) in enumerate(stages)
    ]


def build_report(
    mode: str,
    split: ShardSplit | None,
    speeds: list[float | None],
    results: list[RankResult],
    devices: list[int] | None = None,
    predicted: list[float] | None = None,
    stages: list[tuple[int, int]] | None = None,
    dims: ModelDims | None = None,
) -> RunReport:
    """Combine the workers' results into the report; totals are over measured steps.

    `speeds`, `devices` and `predicted` (compute seconds per step) are indexed by rank.
    A pipeline run gives `stages` (and `dims`) instead of a split.
    """
    devices = devices or list(range(len(results)))
    results = sorted(results, key=lambda r: r.rank)
    if results[0].split is not None:  # the split the job ended with (a re-plan may have changed it)
        split = results[0].split
    kv_rows = (split.kv_rows if split is not None else None) or [None] * len(results)
    if split is not None:
        shares = list(zip(split.kv_groups, split.mlp_columns, split.vocab_rows))
    else:
        if stages is None or dims is None:
            raise ValueError("build_report needs a split, or a pipeline run's stages and dims")
        shares = _pipeline_shares(stages, dims)
    results = sorted(results, key=lambda r: r.rank)
    n = len(results[0].step_seconds)
    steps = measured_range(n, results[0].measure_from)
    step_seconds = [max(r.step_seconds[k] for r in results) for k in range(n)]
    compute = [[r.step_seconds[k] - r.comm_seconds[k] for k in range(n)] for r in results]
    idle_by_step = {k: idle_seconds([c[k] for c in compute]) for k in steps}
    timed_segments = all(len(r.segment_seconds) == n for r in results) and len(results) > 1
    waits = (
        {k: segment_wait_seconds([r.segment_seconds[k] for r in results]) for k in steps} if timed_segments else None
    )
    nodes = []
    for rank, (r, c) in enumerate(zip(results, compute)):
        idle = [idle_by_step[k][rank] for k in steps]
        nodes.append(
            NodeReport(
                rank=r.rank,
                device=devices[r.rank],
                speed=speeds[r.rank],
                predicted_compute_seconds=predicted[r.rank] if predicted else None,
                layers=stages[r.rank] if stages else None,
                kv_groups=shares[r.rank][0],
                kv_rows=kv_rows[r.rank],
                mlp_columns=shares[r.rank][1],
                vocab_rows=shares[r.rank][2],
                compute_seconds=sum(c[k] for k in steps),
                comm_seconds=sum(r.comm_seconds[k] for k in steps),
                idle_seconds=sum(idle),
                idle_ratio=sum(i / step_seconds[k] for i, k in zip(idle, steps)) / len(steps),
                param_bytes=r.param_bytes,
                peak_rss_bytes=r.peak_rss_bytes,
                segment_wait_seconds=sum(waits[k][rank] for k in steps) if waits else None,
                segment_seconds=tuple(sum(r.segment_seconds[k][i] for k in steps) for i in range(3))
                if timed_segments
                else None,
                started_at=r.started_at,
                timeline=r.timeline,
            )
        )
    return RunReport(
        mode=mode,
        world_size=len(results),
        split=split,
        stages=stages,
        losses=results[0].losses,
        step_seconds=step_seconds,
        measured_steps=len(steps),
        mean_step_seconds=sum(step_seconds[k] for k in steps) / len(steps),
        idle_ratio=sum(node.idle_ratio for node in nodes) / len(nodes),
        nodes=nodes,
        replans=results[0].replans,
        collective=results[0].collective,
    )
