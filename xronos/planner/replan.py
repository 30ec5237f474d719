"""Re-planning during a job: profiles recalibrated from the compute each rank measured, and
whether the better split is worth a re-shard (a gain two checks agree on, paid back in time).
A job's first checks re-plan whatever they measure; the later ones only on drift
(`xronos.contract.report.DRIFT_THRESHOLD`), such as a device that another program slowed down.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from xronos.contract.lora import LoraOptions
from xronos.contract.profiles import COMPUTE_FIELDS, SEGMENT_FIELDS, DeviceProfile
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.cost_model import (
    LOSS_ALLREDUCES,
    allreduces_per_step,
    device_compute,
    later_products,
    segments,
    split_step_seconds,
    to_split,
    vocab_later_seconds,
)
from xronos.planner.layouts import IDLE_TOLERANCE
from xronos.planner.partitioner import fits_memory, solve_members, solve_with_memory


def recalibrate(profile: DeviceProfile, factor: float, per_segment: dict[str, float] | None = None) -> DeviceProfile:
    """The profile with its compute seconds scaled by measured / predicted compute (`factor`), and
    the seconds of each segment in `per_segment` (by split dimension, see SEGMENT_FIELDS) by its own.

    A device in a real job can run faster or slower than its micro-benchmark said
    (contention, thermal limits; under an emulated CPU quota, a device that waits
    often in collectives gets its quota back and computes faster), and a short
    micro-benchmark can misjudge one component more than another. Its collectives
    are recalibrated apart (`collective_excess`).
    """
    scaled = {k: getattr(profile, k) * factor for k in COMPUTE_FIELDS}
    for dim, own in (per_segment or {}).items():
        scaled |= {k: getattr(profile, k) * own for k in SEGMENT_FIELDS[dim]}
    return profile.model_copy(update=scaled)


class MeasuredCompute(NamedTuple):
    """One rank's compute seconds per micro-step in a job: in all, and of that, in the attention and MLP
    segments of all its layers and in the vocabulary's (SEGMENT_FIELDS' order; as `edge_node.tp.comm`
    times them; 0: not measured); and its whole step's wall seconds per micro-step (0: not measured)."""

    total: float
    segments: tuple[float, float, float] = (0.0, 0.0, 0.0)
    step: float = 0.0


def segment_compute(
    p: DeviceProfile,
    dims: ModelDims,
    share: tuple[float, float, float],
    mlp_later: bool = False,
    attention_later: bool = False,
    vocab_later: int = 0,
) -> tuple[float, float, float]:
    """A device's predicted compute per micro-step in the attention and MLP segments of all layers and
    in the vocabulary segment, for a share: weight-gradient products counted where they run (moved MLP
    products and `vocab_later` rows' LM head products in the attention's backward spans, deferred
    attention products in the MLP segment)."""
    attention, mlp, vocab = segments(p, dims, *share)
    moved, deferred = later_products(p, dims, share, mlp_later, attention_later)
    spread = vocab_later_seconds(p, dims, vocab_later)
    return (
        dims.num_layers * (attention - deferred + moved) + spread,
        dims.num_layers * (mlp - moved + deferred),
        vocab - spread,
    )


def calibration_factors(
    profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit, measured: list[MeasuredCompute]
) -> list[tuple[float, dict[str, float]]]:
    """Per rank: measured / predicted compute in all, and a factor per segment it holds a share of.

    The whole comes from the totals. A segment's factor comes from how the rank's measured
    segment departs from its prediction, relative to the ranks' geometric mean for that segment
    (a profile prices each unit with its AdamW update, which runs after the segments: a bias all
    ranks share, and what all ranks share cannot be told apart from it), centred over the rank's
    segments (weighted by their predicted seconds) so that the whole keeps its factor to first
    order. A segment the rank holds no share of (only its floor runs) keeps the whole's factor.
    """
    whole, logs, weights = [], [], []
    for r, (p, share, seen) in enumerate(zip(profiles, split.shares(), measured)):
        predicted = device_compute(p, dims, *share)
        whole.append(seen.total / predicted if predicted > 0 and seen.total > 0 else 1.0)
        parts = segment_compute(
            p,
            dims,
            share,
            split.rank_computes_weight_grads_later("mlp_columns", r),
            split.rank_computes_weight_grads_later("kv_groups", r),
            split.vocab_later(r),
        )
        held = [u > 0 and x > 0 and y > 0 for u, x, y in zip(share, parts, seen.segments)]
        logs.append([float(np.log(y / x)) if h else None for h, x, y in zip(held, parts, seen.segments)])
        weights.append([x if h else 0.0 for h, x in zip(held, parts)])
    means = [
        np.mean(known) if (known := [x for row in logs if (x := row[c]) is not None]) else 0.0
        for c in range(len(SEGMENT_FIELDS))
    ]
    factors = []
    for f, row, w in zip(whole, logs, weights):
        rel = {dim: x - mean for dim, x, mean in zip(SEGMENT_FIELDS, row, means) if x is not None}
        centre = sum(w[c] * (x - means[c]) for c, x in enumerate(row) if x is not None) / sum(w) if rel else 0.0
        factors.append((f, {dim: f * float(np.exp(x - centre)) for dim, x in rel.items()}))
    return factors


def collective_excess(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit, step: float) -> float:
    """Seconds per all-reduce by which the measured `step` (wall seconds per micro-step) outruns what
    `profiles` predict for `split` (negative: falls short of it). With the compute recalibrated to the
    job's, what is left is what the collectives cost in the step beyond the profiles' price: the profile
    times a transfer on its device alone, while in a step a throttled rank reaches each all-reduce with its
    quota's period spent, and three ranks finishing together wait for the latest one's jitter (M, speeds
    1, 0.5, 0.25: 7.5-7.9 ms an all-reduce in the step, 4.1 ms priced; docs/benchmarks.md). Per call, for
    that is how it comes: ~the same for every all-reduce, whatever its size."""
    if len(profiles) < 2 or step <= 0:
        return 0.0
    return (step - split_step_seconds(profiles, dims, split)) / (allreduces_per_step(dims) + LOSS_ALLREDUCES)


def add_latency(profile: DeviceProfile, excess: float) -> DeviceProfile:
    """`profile` with `excess` seconds added to its all-reduce latency, never below a quarter of it: the
    profile's own transfer is a floor the job cannot beat by much, whatever a noisy window says."""
    latency = profile.allreduce_latency_seconds
    return profile.model_copy(update={"allreduce_latency_seconds": max(latency / 4, latency + excess)})


RECALIBRATION_STEP = 0.75
"""How far (geometrically) a re-plan moves each profile towards the measured compute: a profile
off by a factor f is off by f**(1/4) after one check. Half-way needed three checks to settle
the strong bench's split (its 0.5 device computes ~1.5x its profile's pace in the job), more
than a 16-step job has room for in its first half."""
MIN_REPLAN_GAIN = 0.03
"""A re-plan re-shards if it predicts at least this much shorter steps."""
CONFIRMED_REPLAN_GAIN = 0.01
"""... or at least this much, when the check before (which kept the split) predicted as much too.

One check's gain under 3% may be measurement noise, but the profiles converge check by check,
and a gain that two checks in a row predict is not: on the strong bench, rounds kept splits that
their last four checks all found 1.3-2.3% slower than the best (mostly a block or two of
vocabulary rows), predicted to idle 7.8-8.4% against the best's 4.7-5.1%; the best split of one
such round's final profiles, run fixed, idled 3.7-4.3% (three runs)."""


def min_replan_gain(
    kept_gain: float | None, reshard_seconds: float | None, step_seconds: float, steps_left: int
) -> float:
    """The predicted gain a check needs to re-shard: MIN_REPLAN_GAIN, or CONFIRMED_REPLAN_GAIN when the
    check before kept the split though it found a gain of at least that much (whichever split it was;
    `kept_gain`; None: it re-sharded, or there was none), raised to what pays back a re-shard's seconds
    (`reshard_seconds`, the last one's, when one has been timed, not counting the warm-up steps after
    it) over the steps left, and never above MIN_REPLAN_GAIN (which re-shards wherever the steps left
    pay the re-shard back: `payback_gain` says where they do)."""
    if kept_gain is None or kept_gain < CONFIRMED_REPLAN_GAIN:
        return MIN_REPLAN_GAIN
    payback = (
        reshard_seconds / (step_seconds * steps_left)
        if reshard_seconds and steps_left > 0 and step_seconds > 0
        else 0.0
    )
    return min(MIN_REPLAN_GAIN, max(CONFIRMED_REPLAN_GAIN, payback))


def payback_gain(reshard_seconds: float | None, step_seconds: float, steps_left: int) -> float:
    """The gain at which a re-shard pays back its seconds (`reshard_seconds`: the last one's, when one has
    been timed, else the job-time estimate; None: counted free) over the steps left, unbounded: what keeps a
    check from re-sharding for less than it costs (1.0 and more: no gain can)."""
    if not reshard_seconds:
        return 0.0
    if steps_left <= 0 or step_seconds <= 0:
        return 1.0
    return reshard_seconds / (step_seconds * steps_left)


def predicted_compute(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit) -> list[float]:
    """Per rank: the compute seconds per micro-step its profile predicts for its share of `split`."""
    return [device_compute(p, dims, *share) for p, share in zip(profiles, split.shares())]


class Replan(NamedTuple):
    """A re-plan's outcome: the split to run (the same one when kept), the profiles recalibrated
    towards the measurement, what the profiles before predicted per rank, and how much shorter the
    best split's step is than the current one's by the recalibrated profiles (0: none better)."""

    split: ShardSplit
    profiles: list[DeviceProfile]
    predicted: list[float]
    gain: float


def replan(
    profiles: list[DeviceProfile],
    dims: ModelDims,
    split: ShardSplit,
    measured: list[MeasuredCompute],
    micro_batch: int,
    seq_len: int,
    min_gain: float = MIN_REPLAN_GAIN,
    tolerance: float = IDLE_TOLERANCE,
    lora: LoraOptions | None = None,
) -> Replan:
    """A new split for the same ranks from measured compute seconds per micro-step (rank order),
    the profiles recalibrated towards the measurement (the next re-plan starts from them,
    so repeated re-plans converge on the measured pace), and what `profiles` predicted.
    The split moves only for a predicted gain of at least `min_gain` (the split it would move to: with
    `tolerance`, the least idle layout within it of the shortest, `least_idle`).

    The ranks stay the ranks (the process group is fixed), so every device keeps taking part.
    """
    predictions = predicted_compute(profiles, dims, split)
    # Most of the way (geometrically) towards the measurement, not all: a device's pace depends
    # on its share (under a CPU quota, the less it waits the slower it computes).
    calibrated = [
        recalibrate(p, f**RECALIBRATION_STEP, {dim: x**RECALIBRATION_STEP for dim, x in own.items()})
        for p, (f, own) in zip(profiles, calibration_factors(profiles, dims, split, measured))
    ]
    # The collectives as the steps ran them, by the same measure (each rank's step is the slowest's).
    excess = collective_excess(calibrated, dims, split, max(m.step for m in measured))
    calibrated = [add_latency(p, excess * RECALIBRATION_STEP) for p in calibrated]
    members = list(range(len(profiles)))
    step, coll, g, m, v, later = solve_members(calibrated, dims, members, micro_batch, tolerance=tolerance)
    if lora is not None:  # a frozen weight has no gradient to compute later (`plan_partition`)
        later = None
    if not fits_memory(calibrated, dims, micro_batch, seq_len, members, g, m, v, lora):
        solved = solve_with_memory(calibrated, dims, micro_batch, seq_len, members, lora=lora)
        if solved is None:
            return Replan(split, profiles, predictions, 0.0)
        step, _, g, m, v, later, _ = solved
    current = split_step_seconds(calibrated, dims, split)
    gain = max(0.0, 1 - step / current) if current > 0 else 0.0
    if gain < min_gain:  # not worth a re-shard (and measurement noise would drive it)
        return Replan(split, calibrated, predictions, gain)
    return Replan(to_split(dims, g, m, v, later), calibrated, predictions, gain)
