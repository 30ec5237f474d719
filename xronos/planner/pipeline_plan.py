"""Planning the pipeline-parallel baseline from the same device profiles.

A stage's time per micro-batch = its layers x the device's seconds per layer
(+ the LM head and loss on the last stage), scaled from the profiled
micro-batch to the pipeline's smaller one. A 1F1B step takes about
(micro-batches + stages - 1) x the slowest stage. For every ordered choice of
devices (which ones take part, and in which order: the LM-head stage can sit
on the fastest device) an exact dynamic program finds the contiguous layer
split that minimises the slowest stage; the best over all orders wins.
Exact for the handful of devices a pipeline uses (orders are enumerated).
"""

from __future__ import annotations

import itertools

from pydantic import BaseModel

from xronos.contract.errors import XronosError
from xronos.contract.profiles import DeviceProfile, head_seconds, layer_seconds
from xronos.contract.splits import ModelDims


class PipelinePlan(BaseModel):
    devices: list[int]
    """Device index of each stage, in stage order."""
    stages: list[tuple[int, int]]
    """Layers [lo, hi) of each stage."""
    stage_seconds: list[float]
    """Predicted compute of each stage per micro-batch."""
    micro_batches: int
    predicted_step_seconds: float


def stages_from_layers(
    layer_counts: list[int], stages: int, num_layers: int, micro_batches: int
) -> list[tuple[int, int]]:
    """Layers [lo, hi) of each stage from an explicit `layers=a/b/c` split (`--split` of mode pp), checked."""
    if len(layer_counts) != stages or sum(layer_counts) != num_layers:
        raise XronosError(
            f"split layers {'+'.join(map(str, layer_counts))} must give {stages} stages "
            f"summing to the model's {num_layers} layers"
        )
    if any(count == 0 for count in layer_counts[1:-1]):
        raise XronosError("a middle pipeline stage needs at least one layer")
    if micro_batches < stages:
        raise XronosError(f"a 1F1B pipeline of {stages} stages needs at least {stages} micro-batches")
    ends = list(itertools.accumulate(layer_counts))
    return [(end - count, end) for end, count in zip(ends, layer_counts)]


def split_layers(per_layer: list[float], head: float, n_layers: int) -> tuple[float, list[tuple[int, int]]]:
    """Exact contiguous min-max split of `n_layers` over stages with the given per-layer seconds.

    Every stage but the last takes at least one layer; the last adds `head`.
    Returns (slowest stage seconds, [lo, hi) per stage).
    """
    n = len(per_layer)
    inf = float("inf")
    # best[s][j]: minimal max-stage time placing layers [0, j) on stages 0..s-1
    best = [[inf] * (n_layers + 1) for _ in range(n + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        last = s == n
        for j in range(n_layers + 1):
            for i in range(j + (1 if last else 0)):  # stage s-1 takes layers [i, j)
                if j - i < 1 and not last:
                    continue
                t = max(best[s - 1][i], (j - i) * per_layer[s - 1] + (head if last else 0.0))
                if t < best[s][j]:
                    best[s][j], cut[s][j] = t, i
    if best[n][n_layers] == inf:
        return inf, []
    stages, j = [], n_layers
    for s in range(n, 0, -1):
        stages.append((cut[s][j], j))
        j = cut[s][j]
    return best[n][n_layers], stages[::-1]


def plan_pipeline(profiles: list[DeviceProfile], dims: ModelDims, batch_size: int, micro_batches: int) -> PipelinePlan:
    """The fastest PP layout over device subsets and orders, for `micro_batches` per step."""
    if batch_size % micro_batches:
        raise XronosError(f"--micro-batches {micro_batches} must divide --batch-size {batch_size}")
    scale = (batch_size / micro_batches) / profiles[0].shape.micro_batch
    best: tuple[float, list[int], list[tuple[int, int]]] | None = None
    for size in range(1, min(len(profiles), dims.num_layers, micro_batches) + 1):  # 1F1B needs M >= stages
        for order in itertools.permutations(range(len(profiles)), size):
            per_layer = [layer_seconds(profiles[d], dims) * scale for d in order]
            head = head_seconds(profiles[order[-1]], dims) * scale
            slowest, stages = split_layers(per_layer, head, dims.num_layers)
            step = (micro_batches + size - 1) * slowest
            if best is None or step < best[0]:
                best = (step, list(order), stages)
    if best is None:
        raise XronosError("no pipeline layout: there are no devices or no layers to place")
    step, devices, stages = best
    seconds = []
    for k, (d, (lo, hi)) in enumerate(zip(devices, stages)):
        head = head_seconds(profiles[d], dims) if k == len(devices) - 1 else 0.0
        seconds.append(((hi - lo) * layer_seconds(profiles[d], dims) + head) * scale)
    return PipelinePlan(
        devices=devices, stages=stages, stage_seconds=seconds, micro_batches=micro_batches, predicted_step_seconds=step
    )
