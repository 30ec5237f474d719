"""Exact splits beside a given attention: the water-fill, the attention layouts, the least idle layout.

For one set of participants: the exact integer min-max split of each segment (`water_fill`), the
best attention layout in whole groups or row shares, the MLP columns and vocabulary rows that fill
the attention's waits, and of the whole-group layouts near the shortest the least idle one. The
solver (`partitioner`) runs them per participant set; docs/architecture.md says why each is exact.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from xronos.contract.profiles import (
    DeviceProfile,
    Segment,
    attention_backward_seconds,
    attention_weight_grad_seconds,
    forward_fractions,
    unit_costs,
    vocab_weight_grad_seconds,
    weight_grad_costs,
)
from xronos.contract.report import mean_idle_ratio
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.cost_model import Later, device_compute, dim_units, to_split


class UnitCost(Protocol):
    """A device's seconds for a number of units (never decreasing in them): a Segment, MlpCost or VocabCost."""

    def seconds(self, units: float) -> float: ...


def water_fill(costs: Sequence[UnitCost], units: int) -> tuple[float, list[int]]:
    """Exact integer min-max: give `units` one at a time to the device that would finish first.

    Device i takes costs[i].seconds(u_i), which never decreases in u_i (the first unit also
    pays the fixed cost). The greedy is exact for any such costs: if T* is the optimum, each
    device can take c_i = max{u : seconds(u) <= T*} units and the c_i add up to at least `units`; the
    greedy takes a unit above T* only when every device is at its c_i, i.e. never.
    """
    heap = [(c.seconds(1), i) for i, c in enumerate(costs)]
    heapq.heapify(heap)
    take = [0] * len(costs)
    for _ in range(units):
        _, i = heapq.heappop(heap)
        take[i] += 1
        heapq.heappush(heap, (costs[i].seconds(take[i] + 1), i))
    return max(c.seconds(u) for c, u in zip(costs, take)), take


class DirectedCost(Protocol):
    """A device's seconds for a number of units before a segment's forward all-reduce, and after it up to
    its backward one (each never decreasing in the units): MlpCost or VocabCost."""

    def forward(self, units: int) -> float: ...

    def backward(self, units: int) -> float: ...

    def seconds(self, units: float) -> float: ...


class _Capped(NamedTuple):
    """A cost that no device may take more than `cap` units of (infinite seconds above)."""

    cost: UnitCost
    cap: int

    def seconds(self, units: float) -> float:
        return self.cost.seconds(units) if units <= self.cap else float("inf")


def direction_fill(costs: Sequence[DirectedCost], units: int) -> tuple[float, list[int]]:
    """Exact integer min of (slowest forward + slowest backward): a segment's two all-reduces each wait
    for their slowest participant.

    Some optimal split's slowest forward is one of the devices' forward seconds at some unit count.
    For each such level F, each device may take at most the units whose forward fits under it; the
    least slowest backward under those caps is the least level B at which the devices' units with
    both fitting add up to `units`. B never rises as F does, so one sweep of F upwards with B moving
    down finds every pair's best in O(candidates) counts. Of the split found, units go by a capped
    water-fill of the whole segment's seconds (so with equal forward parts it is `water_fill`'s).
    A backward that falls somewhere as units rise (a fraction's noise) is taken at its running
    maximum, which the split then never exceeds.
    """
    n = len(costs)
    forward = [[c.forward(u) for u in range(units + 1)] for c in costs]
    backward = []
    for c in costs:
        seconds, top = [], float("-inf")
        for u in range(units + 1):
            top = max(top, c.backward(u))
            seconds.append(top)
        backward.append(seconds)

    def fitting(table: list[float], level: float) -> int:
        return bisect.bisect_right(table, level * (1 + 1e-12)) - 1

    def total(f_level: float, b_level: float) -> int:
        """Units the devices can take with both fitting (-1: a device's floor does not fit)."""
        counts = [min(fitting(forward[i], f_level), fitting(backward[i], b_level)) for i in range(n)]
        return -1 if min(counts) < 0 else sum(counts)

    f_levels = sorted({x for table in forward for x in table})
    b_levels = sorted({x for table in backward for x in table})
    best, j = None, len(b_levels) - 1
    for f in f_levels:
        if total(f, b_levels[j]) < units:
            continue
        while j > 0 and total(f, b_levels[j - 1]) >= units:
            j -= 1
        if best is None or f + b_levels[j] < best[0] - 1e-15:
            best = (f + b_levels[j], f, b_levels[j])
    assert best is not None  # the top levels let every device take every unit
    _, f, b = best
    caps = [min(fitting(forward[i], f), fitting(backward[i], b)) for i in range(n)]
    _, take = water_fill([_Capped(c, cap) for c, cap in zip(costs, caps)], units)
    slowest = max(forward[i][u] for i, u in enumerate(take)) + max(backward[i][u] for i, u in enumerate(take))
    return slowest, take


Share = tuple[int, tuple[int, int] | None]
"""One rank's attention: (KV groups, None) or (1, (r0, r1)): rows r0..r1 of a shared group."""


def attention_layout(
    costs: list[Segment], groups: int, rows: int, layers: int, share_seconds: float, bound: float = float("inf")
) -> tuple[float, list[Share]]:
    """The exact best attention split in rank order: whole groups, or rows of a shared group.

    Minimises layers * (slowest rank's attention seconds) + share_seconds * (groups shared).
    Rank i holding k groups takes costs[i].seconds(k); r of the `rows` rows of a group,
    costs[i].seconds(r / rows) (the fixed cost in full). Dynamic programming over (rank, groups done, rows of
    the open group taken), keeping for each state the Pareto front of (slowest seconds, shares);
    every whole-group split is among the candidates (groups are interchangeable, so rank order
    loses nothing for them). Moves slower than `bound` (a known solution's slowest rank) are
    skipped: they cannot be part of a better one.
    """
    n = len(costs)

    @functools.cache
    def front(i: int, g: int, taken: int) -> tuple:
        """[(slowest, shares, share of rank i, next state)] for ranks i.. from this state, Pareto-pruned."""
        if i == n:
            return ((0.0, 0, None, None),) if g == groups and taken == 0 else ()
        moves: list[tuple[float, tuple[int, int], int, Share]] = []
        if taken == 0:
            moves += [(k, (g + k, 0), 0, (k, None)) for k in range(groups - g + 1)]
            if g < groups:
                moves += [(r / rows, (g, r), 1, (1, (0, r))) for r in range(1, rows)]
        else:
            moves += [
                (r / rows, (g + 1, 0) if taken + r == rows else (g, taken + r), 0, (1, (taken, taken + r)))
                for r in range(1, rows - taken + 1)
            ]
        found = []
        for units, state, new_share, share in moves:
            mine = costs[i].seconds(units)
            if mine > bound * (1 + 1e-12):
                continue
            for slowest, shares, _, _ in front(i + 1, *state):
                found.append((max(mine, slowest), shares + new_share, share, (state, shares)))
        found.sort(key=lambda e: (e[0], e[1]))
        pruned: list[tuple[float, int, Share, tuple[tuple[int, int], int]]] = []
        for entry in found:  # keep each entry that needs fewer shares than every faster one
            if not pruned or entry[1] < pruned[-1][1]:
                pruned.append(entry)
        return tuple(pruned)

    options = front(0, 0, 0)
    if not options:
        raise ValueError("no attention layout within the bound")
    slowest, shares, _, _ = min(options, key=lambda e: (layers * e[0] + share_seconds * e[1], e[1]))
    layout, state, want = [], (0, 0), shares
    for i in range(n):
        entry = next(e for e in front(i, *state) if e[1] == want and e[0] <= slowest * (1 + 1e-12))
        layout.append(entry[2])
        state, want = entry[3]
    front.cache_clear()
    return layers * slowest + share_seconds * shares, layout


ROW_SHARE_MIN_GAIN = 0.03
"""Row shares are used only when they predict a step this much shorter than whole groups.

Their cost is the least certain part of the model: attention on a quarter of the rows costs a
slow device 1.4-1.7x a quarter of a group (per-call work does not shrink; the profile's fixed
attention cost prices part of it), and a segment that three devices finish together lasts as
long as the latest one's jitter. On the strong bench's model and speeds, whole jobs with the
fixed split 2/1[0:3]/1[3:4] (a layout the model without fixed costs predicted 2% faster than
2/1/0) measured 9-21% slower than 2/1/0, round by round
(`benchmarks/attention_share_bench.py --ab-rounds 3`); a whole-group plan is also the one a
re-plan keeps most stably."""


class MlpCost(NamedTuple):
    """A device's MLP segment when its weight-gradient products may move out of it, into the span
    of the layer's attention backward (`edge_node.tp.weight_grads`): they move, all or none, if
    they fit in `room`, the span of the slowest attention backward less the device's own (so the
    attention segment never grows). `extra`: the attention weight-gradient products it takes in
    from the layer above. Never decreases in units (the saving is lost at a jump up), so
    water-filling with it stays exact. (The profile's costs are taken once: water-filling asks often.)"""

    mlp: Segment
    weight_grads: Segment
    room: float
    extra: float = 0.0
    forward_fraction: float = 0.5

    @classmethod
    def of(cls, p: DeviceProfile, room: float, extra: float = 0.0) -> MlpCost:
        return cls(unit_costs(p)[1], weight_grad_costs(p)[0], room, extra, forward_fractions(p)[1])

    def forward(self, units: float) -> float:
        return self.forward_fraction * self.mlp.seconds(units)

    def backward(self, units: float) -> float:
        return self.seconds(units) - self.forward(units)

    def moved(self, units: float) -> float:
        """Seconds moved out of the segment with `units` blocks (0: they do not fit, or there are none)."""
        seconds = self.weight_grads.seconds(units)
        return seconds if 0 < seconds <= self.room else 0.0

    def seconds(self, units: float) -> float:
        return self.mlp.seconds(units) - self.moved(units) + self.extra


def mlp_costs(
    profiles: list[DeviceProfile], attention_units: Sequence[float] | None, deferred: list[float] | None = None
) -> list[MlpCost]:
    """Each device's MLP cost beside these attention shares, of which each device defers `deferred`
    seconds of weight-gradient products to its MLP segment (None: room without limit, a lower bound)."""
    if attention_units is None:
        return [MlpCost.of(p, float("inf")) for p in profiles]
    deferred = deferred or [0.0] * len(profiles)
    backs = [attention_backward_seconds(p, a) - d for p, a, d in zip(profiles, attention_units, deferred)]
    # a device defers one of the two at most: its attention's products to the MLP segment, or its
    # MLP's to the attention's (a deferring device gets no room)
    return [MlpCost.of(p, 0.0 if d > 0 else max(backs) - b, d) for p, b, d in zip(profiles, backs, deferred)]


def mlp_split(costs: list[MlpCost], blocks: int) -> tuple[float, list[int], list[bool]]:
    """MLP blocks by the slowest forward plus the slowest backward (`direction_fill`), and which devices'
    weight gradients come later."""
    tm, m = direction_fill(costs, blocks)
    return tm, m, [c.moved(u) > 0 for c, u in zip(costs, m)]


class VocabCost(NamedTuple):
    """A device's vocabulary segment when the LM head weight-gradient products of up to `cap` of its
    blocks may leave it, a layer's worth into the room each attention backward span leaves it after
    its MLP's moves (so no span grows). Never decreases in units (a block still costs its seconds
    less its products), so water-filling with it stays exact."""

    vocab: Segment
    weight_grads: Segment
    cap: int
    forward_fraction: float = 0.5

    @classmethod
    def of(cls, p: DeviceProfile, cap: int) -> VocabCost:
        return cls(unit_costs(p)[2], weight_grad_costs(p)[1], cap, forward_fractions(p)[2])

    def later(self, units: float) -> int:
        return min(int(units), self.cap)

    def seconds(self, units: float) -> float:
        return self.vocab.seconds(units) - self.weight_grads.seconds(self.later(units))

    def forward(self, units: float) -> float:
        return self.forward_fraction * self.vocab.seconds(units)

    def backward(self, units: float) -> float:
        return self.seconds(units) - self.forward(units)


def vocab_beside(profiles: list[DeviceProfile], dims: ModelDims, rooms: list[float] | None, later: Later):
    """The vocabulary water-filled with each device's LM head products moved (by whole blocks) into the
    `rooms` its attention backward spans have left, per layer, after its MLP's moves (None: room without
    limit, a lower bound). Returns (seconds, blocks, `later` with the moves)."""
    blocks = dim_units(dims)[2]
    costs = []
    for i, p in enumerate(profiles):
        per_block = vocab_weight_grad_seconds(p, 1)
        if rooms is None:
            fits = blocks
        else:
            fits = (
                min(blocks, int(dims.num_layers * rooms[i] / per_block * (1 + 1e-12)))
                if per_block > 0 and rooms[i] > 0
                else 0
            )
        costs.append(VocabCost.of(p, fits))
    tv, v = direction_fill(costs, blocks)
    taken = [c.later(u) for c, u in zip(costs, v)]
    return tv, v, later._replace(vocab=taken if any(taken) else None)


def _attention_then_mlp(profiles: list[DeviceProfile], units: Sequence[float], blocks: int):
    """Given each device's attention units: which devices defer their attention's weight gradients
    to the MLP segment, and the MLP split beside that. Returns (attention + MLP seconds per layer,
    MLP blocks, Later, each device's room left in its attention backward span after its MLP moves).

    Exact for these units, a device deferring one of its two components at most: deferring its
    attention shortens its backward alone and helps only a device whose attention backward is the
    segment's longest (elsewhere it only lengthens its MLP and shortens the others' room), so some
    optimal choice defers exactly the devices above a level; each of the n + 1 levels is tried (with
    its exact MLP split), no deferral first, so ties keep the plainer plan.
    """
    attention = [unit_costs(p)[0].seconds(u) for p, u in zip(profiles, units)]
    forward = [f * a for f, a in zip((forward_fractions(p)[0] for p in profiles), attention)]
    backward = [a - f for a, f in zip(attention, forward)]
    deferrable = [attention_weight_grad_seconds(p, u) for p, u in zip(profiles, units)]
    best = None
    levels = sorted({b for b, d in zip(backward, deferrable) if d > 0}, reverse=True)
    for level in [float("inf")] + levels[1:] + [-1.0]:  # nothing deferred, then the top device(s), ...
        defer = [b > level and d > 0 for b, d in zip(backward, deferrable)]
        deferred = [d if f else 0.0 for d, f in zip(deferrable, defer)]
        ta = max(forward) + max(b - d for b, d in zip(backward, deferred))
        costs = mlp_costs(profiles, units, deferred)
        tm, m, mlp_later = mlp_split(costs, blocks)
        if best is None or ta + tm < best[0] - 1e-12:
            best = (ta + tm, m, Later(mlp_later, defer), [c.room - c.moved(u) for c, u in zip(costs, m)])
    return best


def beside_attention(profiles: list[DeviceProfile], dims: ModelDims, units: Sequence[float]):
    """Given each device's attention units (KV groups, a fraction where rows share one): the best MLP
    and vocabulary beside it (`_attention_then_mlp`, then `vocab_beside`). Returns (the step's
    compute seconds, collectives apart; MLP blocks, vocabulary blocks, Later)."""
    seconds, m, later, rooms = _attention_then_mlp(profiles, units, dim_units(dims)[1])
    tv, v, later = vocab_beside(profiles, dims, rooms, later)
    return dims.num_layers * seconds + tv, m, v, later


def best_split_with_attention(profiles: list[DeviceProfile], dims: ModelDims, kv_groups: list[int]) -> ShardSplit:
    """The best split for these devices (rank order) whose attention is `kv_groups` whole KV groups
    each: what the plan would pick beside a layout it did not choose (to price that layout)."""
    _, m, v, later = beside_attention(profiles, dims, kv_groups)
    return to_split(dims, kv_groups, m, v, later)


IDLE_TOLERANCE = 0.02
"""Whole-group attention layouts whose best splits predict steps within this of the shortest are
equally short as far as the profiles can tell; of those the plan takes the one whose devices finish
closest together (least predicted idle). Fixed splits run alternately on the strong bench measured
a layout the profiles priced 3% slower as fast (1.42-1.46 s against 1.43-1.46 s), and the shortest
layout there, kv 3/0/0, leaves the two slower devices idle through its attention's forward half
(~6% predicted). Against the exact shortest, twelve bench rounds a side (arms alternated), mean
idle went 6.5% -> 4.7% on strong (steps 1.6% longer) and 4.2% -> 2.3% on mild (steps equal).
0: the exact shortest (what the brute-force tests check)."""
MAX_LAYOUTS = 64
"""Whole-group layouts priced per participant set at most (see `attention_candidates`): every layout
of 3 KV groups over 3 devices (10) or of 8 over 3 (45); 3 partitions of 3 groups over tens of
devices, 22 of 8. Models with many KV heads (multi-head attention) over many devices have more,
and there whole groups divide at the devices' speeds almost exactly anyway."""


def attention_candidates(costs: list[Segment], groups: int, first: list[list[int]]) -> list[list[int]]:
    """Whole-group attention layouts worth pricing: `first` (the min-max ones), then every layout of
    `groups` over the devices when there are at most MAX_LAYOUTS (so the plan's is the best of them
    all), else each partition of `groups` into at most one part per device, the larger parts to the
    devices faster at one group, when there are at most MAX_LAYOUTS of those, else none."""
    n = len(costs)

    def compositions(total: int, parts: int):
        if parts == 1:
            yield [total]
            return
        for k in range(total, -1, -1):
            for rest in compositions(total - k, parts - 1):
                yield [k, *rest]

    def partitions(total: int, most: int, parts: int):
        if total == 0:
            yield [0] * parts
            return
        if parts == 0:
            return
        for k in range(min(total, most), 0, -1):
            for rest in partitions(total - k, k, parts - 1):
                yield [k, *rest]

    def speed_ordered(parts: list[int]) -> list[int]:
        layout = [0] * n
        for i, k in zip(sorted(range(n), key=lambda i: (costs[i].seconds(1), i)), parts):
            layout[i] = k
        return layout

    found = [list(g) for g in first]
    for source in (compositions(groups, n), map(speed_ordered, partitions(groups, groups, n))):
        more = list(itertools.islice(source, MAX_LAYOUTS + 1))
        if len(more) <= MAX_LAYOUTS:
            return found + [g for g in more if g not in found]
    return found


def least_idle(profiles: list[DeviceProfile], dims: ModelDims, options: list[tuple], tolerance: float) -> tuple:
    """Of (step, attention units, MLP blocks, vocabulary blocks, Later) options for the same devices:
    the one with the least predicted idle among those within `tolerance` of the shortest step
    (IDLE_TOLERANCE), the shorter on a tie, the earlier on a tie of both."""
    shortest = min(o[0] for o in options)
    near = [o for o in options if o[0] <= shortest * (1 + tolerance) + 1e-12]
    if len(near) == 1:
        return near[0]

    def idle(option) -> float:
        step, g, m, v, later = option
        compute = [
            device_compute(p, dims, *share) for p, share in zip(profiles, to_split(dims, g, m, v, later).shares())
        ]
        return mean_idle_ratio(compute, step)

    return min(near, key=lambda o: (round(idle(o), 9), o[0]))
