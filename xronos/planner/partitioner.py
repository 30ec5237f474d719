"""The exact heterogeneity-aware partitioner: the split that minimises the step time.

`plan_partition` tries the participant sets worth trying (a device that costs more than it brings
is left out), solves each exactly (`layouts`; with memory binding, a mixed-integer program by HiGHS),
and keeps the shortest step, of those within IDLE_TOLERANCE of it the least idle. The derivation,
and why a proportional split with rounding is not enough: docs/architecture.md.
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import BaseModel, ConfigDict
from scipy.optimize import Bounds, LinearConstraint, milp

from xronos.contract.errors import XronosError
from xronos.contract.lora import LoraOptions
from xronos.contract.profiles import DeviceProfile, Segment, attention_kept, unit_costs
from xronos.contract.report import idle_seconds, mean_idle_ratio
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.cost_model import (
    Later,
    collective_seconds,
    device_compute,
    dim_units,
    shared_grad_seconds,
    split_step_seconds,
    to_split,
    unit_bytes,
)
from xronos.planner.layouts import (
    IDLE_TOLERANCE,
    ROW_SHARE_MIN_GAIN,
    attention_candidates,
    attention_layout,
    beside_attention,
    least_idle,
    mlp_costs,
    mlp_split,
    vocab_beside,
    water_fill,
)


class DeviceCost(BaseModel):
    """Predicted seconds and bytes of one device for a given share."""

    device: str
    rank: int | None
    kv_groups: int
    kv_rows: tuple[int, int] | None = None
    """Rows of each micro-batch it computes its (shared) KV group for; None: all."""
    mlp_columns: int
    vocab_rows: int
    compute_seconds: float
    idle_seconds: float = 0.0
    """Predicted as measured: the slowest participant's compute seconds minus this device's."""
    memory_bytes: int
    reason: str | None = None


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    split: ShardSplit
    devices: list[DeviceCost]
    collective_seconds: float
    predicted_step_seconds: float
    predicted_idle_ratio: float = 0.0
    """Mean over participants of idle / step: what the report measures as the idle ratio. Part of
    it can be structural: whole KV groups may not divide among devices at their speeds."""
    optimal: bool = True
    """False only when memory binds for many devices and the solver's time ran out: the best plan found."""


MILP_OPTIONS = {"time_limit": 0.5}
"""HiGHS per participant set; a set that hits the limit keeps its best integer solution."""
PLAN_BUDGET_SECONDS = 3.0
"""When memory binds for many devices, stop trying further participant sets after this long."""


def solve_with_memory(profiles, dims, micro_batch, seq_len, members: list[int], relax: bool = False, lora=None):
    """The same problem for a fixed participant set, with each device's memory limit, by HiGHS.

    Only needed when the water-filled split does not fit; returns (step, collectives, g, m, v,
    None: no weight gradients later, this program leaves them out, proven optimal), or None when
    the devices cannot hold the model. With `relax`, the LP relaxation: its step is a lower bound, in
    seconds. A binary per device and component says whether it pays that component's fixed
    cost; with fixed costs many memory-bound devices can take HiGHS past MILP_OPTIONS' limit
    (the plan then says `optimal: false`). Its segments are priced by their slowest sums (linear),
    not by slowest forward plus slowest backward (`step_seconds`): the same where the devices' forward
    parts are, else the split is the sums' best and the caller prices it by direction.
    """
    k, layers = len(members), dims.num_layers
    units = dim_units(dims)
    costs = [unit_costs(profiles[i]) for i in members]
    fixed_b, kv_b, mlp_b, vocab_b = unit_bytes(dims, micro_batch, seq_len, lora)
    # variables: g[0..k) m[k..2k) v[2k..3k), whether each is > 0: [3k..6k), then Ta Tm Tv
    T = [6 * k, 6 * k + 1, 6 * k + 2]
    n_vars = 6 * k + 3
    rows, lo, hi = [], [], []

    def add(coeffs: dict[int, float], lower: float, upper: float):
        row = np.zeros(n_vars)
        for idx, c in coeffs.items():
            row[idx] += c
        rows.append(row)
        lo.append(lower)
        hi.append(upper)

    for s, total in enumerate(units):
        add({s * k + i: 1 for i in range(k)}, total, total)
    for i, device in enumerate(costs):
        for s, (seg, total) in enumerate(zip(device, units)):
            x, used = s * k + i, 3 * k + s * k + i
            add({T[s]: 1, x: -seg.per_unit, used: -seg.fixed}, seg.floor, np.inf)  # T >= this device's seconds
            add({x: 1, used: -total}, -np.inf, 0)  # units only where the fixed cost is paid
        gib = 2.0**30  # in GiB: rows of similar magnitude keep HiGHS fast
        add(
            {i: kv_b / gib, k + i: mlp_b / gib, 2 * k + i: vocab_b / gib},
            -np.inf,
            (profiles[members[i]].memory_bytes - fixed_b) / gib,
        )
    objective = np.zeros(n_vars)
    objective[T] = [layers, layers, 1]
    integrality = np.r_[np.zeros(6 * k) if relax else np.ones(6 * k), np.zeros(3)]
    upper = np.r_[np.repeat(units, k), np.ones(3 * k), [np.inf] * 3]
    res = milp(
        objective,
        constraints=LinearConstraint(np.array(rows), lo, hi),
        integrality=integrality,
        bounds=Bounds(np.zeros(n_vars), upper),
        options=MILP_OPTIONS,
    )
    if res.x is None:
        return None
    x = np.round(res.x[: 3 * k]).astype(int).tolist()
    coll = max(collective_seconds(profiles[i], dims) for i in members) if k > 1 else 0.0
    return res.fun + coll, coll, [(g, None) for g in x[:k]], x[k : 2 * k], x[2 * k :], None, res.status == 0


def solve_members(
    profiles, dims, members: list[int], rows: int = 1, whole_groups: bool = False, tolerance: float = 0.0
):
    """The best split among exactly `members` (no memory limits), for micro-batches of `rows` rows:
    the vocabulary segment water-filled, the attention laid out by `attention_layout` (or
    water-filled in whole groups, and then only a lower bound when `rows` > 1), and the MLP
    water-filled beside that attention (its weight gradients may go where the attention leaves room).
    The attention's own split is the min-max one, the min-max one of what is left when every
    device defers its attention's weight gradients, or another partition of the groups
    (`attention_candidates`): the one that makes the shortest step or, with `tolerance`, the least
    idle one within it of the shortest (`least_idle`).
    Returns (step, collectives, attention shares, MLP blocks, vocabulary blocks, Later)."""
    G, MB, VB = dim_units(dims)
    part = [profiles[i] for i in members]
    attn = [unit_costs(p)[0] for p in part]
    ta, g = water_fill(attn, G)
    coll = max(collective_seconds(p, dims) for p in part) if len(members) > 1 else 0.0
    L = dims.num_layers
    kept = [attention_kept(p) for p in part]
    # no MLP or vocabulary is shorter than with all its weight gradients moved and none taken in
    tm_least, m, mlp_later = mlp_split(mlp_costs(part, None), MB)
    tv_least, v, moves = vocab_beside(part, dims, None, Later(mlp_later, [False] * len(part)))
    if whole_groups and rows > 1 and len(members) > 1:
        # and row shares can only go as low as the fractional water level of the attention that no
        # deferral removes
        return L * (_fractional_level(kept, G) + tm_least) + tv_least + coll, coll, [(k, None) for k in g], m, v, moves
    g_kept = water_fill(kept, G)[1]
    options: list[tuple[float, list[int], list[int], list[int], Later]] = []
    for groups in attention_candidates(attn, G, [g] + ([g_kept] if g_kept != g else [])):
        # nor any attention segment than its slowest device's with its products deferred: a layout
        # that cannot come within the tolerance of the shortest so far is not priced
        bound = L * (max(k.seconds(u) for k, u in zip(kept, groups)) + tm_least) + tv_least + coll
        if options and bound > min(o[0] for o in options) * (1 + tolerance) + 1e-12:
            continue
        compute, m, v, later = beside_attention(part, dims, groups)
        options.append((compute + coll, groups, m, v, later))
    shortest = min(o[0] for o in options)
    step, groups, m, v, later = least_idle(part, dims, options, tolerance)
    whole = (step, coll, [(k, None) for k in groups], m, v, later)
    if rows == 1 or len(members) == 1:
        return whole
    share = max(shared_grad_seconds(p, dims, 1) for p in part)
    _, layout = attention_layout(list(attn), G, rows, L, share, bound=ta)
    units = [k if r is None else (r[1] - r[0]) / rows for k, r in layout]
    shared = sum(1 for _, r in layout if r is not None and r[0] == 0)
    compute, m_rows, v, later_rows = beside_attention(part, dims, units)
    step = compute + share * shared + coll
    if step > shortest * (1 - ROW_SHARE_MIN_GAIN):
        return whole
    return step, coll, layout, m_rows, v, later_rows


def _fractional_level(costs: list[Segment], units: int) -> float:
    """The water level if units could be split at will and cost no fixed seconds: a lower bound
    on any split's slowest device.

    Every device pays its floor, so the level is at least the highest floor, and from there
    each device fills at its own rate: level = (units + sum f/p) / sum 1/p, in closed form.
    """
    floors, per_unit = [c.floor for c in costs], [c.per_unit for c in costs]
    if any(p <= 0 for p in per_unit):
        return max(floors)
    level = (units + sum(f / p for f, p in zip(floors, per_unit))) / sum(1 / p for p in per_unit)
    return max(max(floors), level)


def _closed_sets(profiles, dims) -> list[list[int]]:
    """Candidate participant sets. Adding a device never slows a segment's water level (it may
    take nothing, and then pays no component's fixed cost), only its floors (the replicated
    work every participant does) and the collectives can rise, so some optimal set contains
    every device whose floors and collective cost are no larger than the set's maxima:
    enumerate those closures (duplicates removed; few when costs grow with slowness).
    For each distinct closure in the first two keys, the closures in the third are its
    prefixes in that key's order, so 64 devices take milliseconds."""
    keys = np.array(
        [
            (attn.floor, vocab.floor, collective_seconds(p, dims))
            for p, (attn, _, vocab) in zip(profiles, map(unit_costs, profiles))
        ]
    )
    found: dict[tuple[int, ...], None] = {}
    seen: set[bytes] = set()
    for a in np.unique(keys[:, 0]):
        for b in np.unique(keys[:, 1]):
            inside = np.flatnonzero((keys[:, 0] <= a) & (keys[:, 1] <= b))
            if inside.size == 0 or inside.tobytes() in seen:
                continue
            seen.add(inside.tobytes())
            by_c = inside[np.argsort(keys[inside, 2], kind="stable")]
            c = keys[by_c, 2]
            for end in range(1, len(by_c) + 1):
                if end == len(by_c) or c[end] > c[end - 1]:  # ties enter together
                    found[tuple(sorted(by_c[:end].tolist()))] = None
    for i in range(len(profiles)):  # alone: no collectives at all
        found[(i,)] = None
    return [list(m) for m in found]


def share_bytes(dims, micro_batch, seq_len, kv_groups: float, mlp_blocks: int, vocab_blocks: int, lora=None) -> float:
    """The memory a device holding this share needs (`unit_bytes`)."""
    fixed, kv_b, mlp_b, vocab_b = unit_bytes(dims, micro_batch, seq_len, lora)
    return fixed + kv_groups * kv_b + mlp_blocks * mlp_b + vocab_blocks * vocab_b


def fits_memory(profiles, dims, micro_batch, seq_len, members, g, m, v, lora=None) -> bool:
    return all(
        share_bytes(dims, micro_batch, seq_len, g[k][0], m[k], v[k], lora) <= profiles[i].memory_bytes
        for k, i in enumerate(members)
    )


def plan_partition(
    profiles: list[DeviceProfile],
    dims: ModelDims,
    micro_batch: int,
    seq_len: int,
    tolerance: float = IDLE_TOLERANCE,
    lora: LoraOptions | None = None,
) -> Plan:
    """The exact min-step plan over all devices (some may be left out, with a reason), or with
    `tolerance` its least idle attention layout within that of the shortest (`least_idle`).

    Each candidate participant set is solved exactly by water-filling each segment; when
    that split does not fit some device's memory, the set is solved by HiGHS with the
    memory constraints instead. A `lora` job's memory is its frozen base weights and its factors
    (`unit_bytes`), and its split computes no weight gradient later: a frozen weight has none (its
    profiles, measured with LoRA applied, price none either).
    """
    if not profiles:
        raise XronosError("no device profiles to plan with")
    n = len(profiles)
    best = None
    # the memory-free optimum of a set bounds its memory-bound one from below: solve the
    # sets in order of a lower bound of that (fractional attention when groups may be
    # shared by rows) and stop once it cannot beat the best (branch and bound)
    bounds = sorted(
        (
            (solve_members(profiles, dims, members, micro_batch, whole_groups=True)[0], members)
            for members in _closed_sets(profiles, dims)
        ),
        key=lambda bm: bm[0],
    )
    optimal, started = True, time.perf_counter()
    for lower, members in bounds:
        if best is not None and lower >= best[0] - 1e-12:
            break
        step, coll, g, m, v, later = solve_members(profiles, dims, members, micro_batch, tolerance=tolerance)
        if best is not None and step >= best[0] - 1e-12:
            continue
        if not fits_memory(profiles, dims, micro_batch, seq_len, members, g, m, v, lora):
            if best is not None and time.perf_counter() - started > PLAN_BUDGET_SECONDS:
                optimal = False  # sets left untried
                break
            bound = solve_with_memory(profiles, dims, micro_batch, seq_len, members, relax=True, lora=lora)
            if bound is None or (best is not None and bound[0] >= best[0] - 1e-12):
                continue  # cannot hold the model, or cannot beat the best even fractionally
            solved = solve_with_memory(profiles, dims, micro_batch, seq_len, members, lora=lora)
            if solved is None:
                continue  # these devices cannot hold the model together
            step, coll, g, m, v, later, proven = solved
            optimal &= proven
            # the program prices each segment by its slowest sum, a lower bound: its split is priced as any other
            step = split_step_seconds([profiles[i] for i in members], dims, to_split(dims, g, m, v))
        if best is None or step < best[0] - 1e-12:
            best = (step, coll, members, g, m, v, later)
    if best is None:
        raise XronosError("no device, nor any group of devices, has the memory for this model at these shapes")
    step, coll, members, g, m, v, later = best
    later = later if lora is None else None
    full = lambda part, none=0: [part[members.index(i)] if i in members else none for i in range(n)]  # noqa: E731
    y = [1 if i in members else 0 for i in range(n)]
    plan = _explain(
        profiles,
        dims,
        micro_batch,
        seq_len,
        full(g, (0, None)),
        full(m),
        full(v),
        y,
        coll,
        Later(full(later.mlp, False), full(later.attention, False), full(later.vocab) if later.vocab else None)
        if later
        else None,
        lora,
    )
    return plan if optimal else plan.model_copy(update={"optimal": False})


def _explain(profiles, dims, micro_batch, seq_len, g, m, v, y, coll, later=None, lora=None) -> Plan:
    members = [i for i in range(len(profiles)) if y[i]]
    split = to_split(
        dims,
        [g[i] for i in members],
        [m[i] for i in members],
        [v[i] for i in members],
        later.select(members) if later else None,
    )
    fixed_bytes, kv_bytes, mlp_bytes, vocab_bytes = unit_bytes(dims, micro_batch, seq_len, lora)
    devices, shares = [], split.shares()
    for i, p in enumerate(profiles):
        if i not in members:
            if fixed_bytes + min(kv_bytes, mlp_bytes, vocab_bytes) > p.memory_bytes:
                reason = f"too little memory: {p.memory_bytes / 2**20:.0f} MiB free, a share needs more"
            else:
                reason = "too slow: its share would save less than it adds to every collective"
            devices.append(
                DeviceCost(
                    device=p.device,
                    rank=None,
                    kv_groups=0,
                    mlp_columns=0,
                    vocab_rows=0,
                    compute_seconds=0.0,
                    memory_bytes=0,
                    reason=reason,
                )
            )
            continue
        rank = members.index(i)
        kv, mlp, vocab = split.kv_groups[rank], split.mlp_columns[rank], split.vocab_rows[rank]
        memory = fixed_bytes + kv * kv_bytes + mlp / dims.mlp_block * mlp_bytes + vocab / dims.vocab_block * vocab_bytes
        devices.append(
            DeviceCost(
                device=p.device,
                rank=rank,
                kv_groups=kv,
                kv_rows=split.kv_rows[rank] if split.kv_rows else None,
                mlp_columns=mlp,
                vocab_rows=vocab,
                compute_seconds=device_compute(p, dims, *shares[rank]),
                memory_bytes=int(memory),
            )
        )
    step = split_step_seconds([profiles[i] for i in members], dims, split)
    coll = coll if len(members) > 1 else 0.0
    compute = [d.compute_seconds for d in devices if d.rank is not None]  # rank order = device order
    idle = idle_seconds(compute)
    devices = [d if d.rank is None else d.model_copy(update={"idle_seconds": idle[d.rank]}) for d in devices]
    return Plan(
        split=split,
        devices=devices,
        collective_seconds=coll,
        predicted_step_seconds=step,
        predicted_idle_ratio=mean_idle_ratio(compute, step),
    )
