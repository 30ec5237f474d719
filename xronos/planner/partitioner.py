"""The exact heterogeneity-aware partitioner: the split that minimises the step time.

Model of one step (per micro-batch; pure arithmetic on measured profiles).
Every all-reduce is a barrier, so a step is a sum of segments, and each
segment lasts as long as its slowest device:
    attention segment of a layer:  max_i (layer_fixed_i / 2 + [g_i > 0] kv_fixed_i + g_i * kv_i)
    MLP segment of a layer:        max_i (layer_fixed_i / 2 + [m_i > 0] mlp_fixed_i + m_i * mlp_i)
    vocabulary segment (once):     max_i (step_fixed_i + [v_i > 0] vocab_fixed_i + v_i * vocab_i)
    step = L * (attention + MLP) + vocabulary + collectives
    collectives = n_allreduce * max over participants (latency_j + MiB * per_mib_j)
                  * (1 + S * group MiB / activation MiB / n_allreduce)
g_i counts KV groups, or a fraction of one: neighbouring ranks may share a
group by rows of the micro-batch (see `xronos.contract.splits`), at the price of one
all-reduce per step of the S shared groups' gradients (costed like activation
all-reduces of the same size, so it scales each device's collective cost).
A component's fixed cost (per-call work that does not shrink with the share)
is paid only by a device holding some of it: a small share on a slow device
costs more than its fraction, and the plan knows it.
A device may compute its MLP's weight-gradient products one backward all-reduce
later, in the span of the layer's attention backward (`edge_node.tp.weight_grads`):
its MLP segment loses w_i = mlp_weight_grad_fraction_i * (its MLP seconds less the
floor), and it is planned so only where w_i fits in the room that span leaves it,
max_j b_j - b_i with b_j = attention_backward_fraction_j * attention_j (a device with
less attention than the slowest waits there anyway); a split evaluated with moves that
do not fit pays the overflow in its attention segment. The other way round, a device may
compute its attention's weight-gradient products later, in the MLP segment of the layer
below: its attention segment loses d_i = attention_weight_grad_fraction_i * (its attention
seconds less the floor) and its MLP segment gains them. Whole KV groups rarely divide at the
devices' speeds, and the MLP segment, split by the column block, takes up what they cannot.
What room its MLP's moves leave a device (one that defers its attention's products has none), the
LM head's weight-gradient products of some of its vocabulary rows take, a layer's worth in each
attention backward span: its vocabulary segment loses x_i = vocab_weight_grad_fraction_i *
vocab_block_seconds_i * (blocks moved), and each span gains x_i / L (what does not fit lengthens
it, as above).
(Balancing only each device's total would let one device do all the
attention while the others wait, then the reverse in the MLP.) Every
participant takes part in every all-reduce at its own CPU speed, so the
slowest participant's collective cost is paid by all; a device whose
participation costs more than its share saves is better left out. A lone
device needs no collectives at all. (The job may all-reduce by gloo's ring or
through a hub, `edge_node.tp.comm`; the term prices both alike: what it
decides is who takes part.)

Exact by construction: for a given set of participants the segments are
independent, and each is an integer min-max allocation that greedy
water-filling solves exactly; the participant sets worth trying are the
"closed" ones (see `_closed_sets`). With weight gradients that may come later
the MLP segment depends on the attention split: each whole-group attention
layout (all of them where there are few, `attention_candidates`) is priced with
the deferrals and the MLP exact beside it, moves only into the room it leaves,
and the vocabulary exact beside both (its moves only into the room the MLP's
leave), and the shortest is taken. That is never slower than the exact plan without moves; letting
moves lengthen the attention segment could still do better (`_solve_members`).
Of the layouts within IDLE_TOLERANCE of the shortest, the plan takes the least idle one (with
tolerance 0: the shortest, what the brute-force tests check). When a water-filled split does not fit a
device's memory, that set is solved with its memory limits as a
mixed-integer program by HiGHS (`scipy.optimize.milp`). Brute-force tests
check optimality on small cases.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from typing import NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict
from scipy.optimize import Bounds, LinearConstraint, milp

from xronos.contract.errors import XronosError
from xronos.contract.profiles import (COMPUTE_FIELDS, SEGMENT_FIELDS, DeviceProfile, Segment,
                             attention_backward_seconds, attention_kept, attention_weight_grad_seconds, unit_costs,
                             weight_grad_costs,
                             vocab_weight_grad_seconds, weight_grad_seconds)
from xronos.contract.report import idle_seconds, mean_idle_ratio
from xronos.contract.splits import ModelDims, ShardSplit

BYTES_PER_PARAM = 16
"""float32 parameter + gradient + two AdamW moments."""
RUNTIME_BYTES = 400 * 2**20
"""Python, torch and transformers loaded: what a worker uses before any tensor."""


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


# -- the pure cost model -----------------------------------------------------------


def allreduces_per_step(dims: ModelDims) -> int:
    """Per micro-batch: 2 forward + 2 backward per layer, the embedding's sum, the final norm's gradient."""
    return 4 * dims.num_layers + 2


def payload_mib(dims: ModelDims, micro_batch: int, seq_len: int) -> float:
    return micro_batch * seq_len * dims.hidden_size * 4 / 2**20


def collective_seconds(p: DeviceProfile, dims: ModelDims) -> float:
    """This device's cost for one step's all-reduces (what every participant waits for)."""
    mib = payload_mib(dims, p.shape.micro_batch, p.shape.seq_len)
    return allreduces_per_step(dims) * (p.allreduce_latency_seconds + mib * p.allreduce_seconds_per_mib)


def group_mib(dims: ModelDims) -> float:
    """One KV group's attention weights (q, k, v, o), all layers: what a shared group's gradient all-reduce moves."""
    return dims.num_layers * 2 * (dims.heads_per_group + 1) * dims.head_dim * dims.hidden_size * 4 / 2**20


def shared_grad_seconds(p: DeviceProfile, dims: ModelDims, groups: int) -> float:
    """This device's cost for summing the gradients of `groups` row-shared KV groups (once per step).

    Costed as that many MiB of activation all-reduces, so that it orders devices exactly
    as `collective_seconds` does (the participant sets worth trying stay the closed ones).
    """
    mib = payload_mib(dims, p.shape.micro_batch, p.shape.seq_len)
    return groups * group_mib(dims) / mib * collective_seconds(p, dims) / allreduces_per_step(dims)


def segments(p: DeviceProfile, dims: ModelDims, kv_groups: float, mlp_columns: float, vocab_rows: float):
    """This device's (attention, MLP, vocabulary) segment seconds for a share."""
    attn, mlp, vocab = unit_costs(p)
    return attn.seconds(kv_groups), mlp.seconds(mlp_columns / dims.mlp_block), vocab.seconds(vocab_rows / dims.vocab_block)


def later_products(p: DeviceProfile, dims: ModelDims, share: tuple[float, float, float], mlp_later: bool,
                   attention_later: bool) -> tuple[float, float]:
    """Per layer, for a device holding `share`: the seconds of MLP weight-gradient products it moves into
    its attention's backward span, and of attention products it defers to the MLP segment below."""
    return (weight_grad_seconds(p, share[1] / dims.mlp_block) if mlp_later else 0.0,
            attention_weight_grad_seconds(p, share[0]) if attention_later else 0.0)


def device_compute(p: DeviceProfile, dims: ModelDims, kv_groups: float, mlp_columns: float, vocab_rows: float) -> float:
    """Predicted compute seconds of one micro-step for a device holding this share."""
    attn, mlp, vocab = segments(p, dims, kv_groups, mlp_columns, vocab_rows)
    return dims.num_layers * (attn + mlp) + vocab


def vocab_later_seconds(p: DeviceProfile, dims: ModelDims, rows: int) -> float:
    """Per micro-step, the LM head weight-gradient products of `rows` vocabulary rows computed later."""
    return vocab_weight_grad_seconds(p, rows / dims.vocab_block) if rows else 0.0


def step_seconds(profiles: list[DeviceProfile], dims: ModelDims, shares: list[tuple[float, float, float]],
                 shared_groups: int = 0, later: list[bool] | None = None,
                 attention_later: list[bool] | None = None, vocab_later: list[int] | None = None) -> float:
    """Predicted step of participants `profiles` holding `shares` (kv groups, MLP columns, vocabulary rows),
    with `shared_groups` KV groups shared by rows, the ranks flagged in `later` computing their
    MLP's weight gradients in the attention backward's span (what does not fit lengthens it),
    those flagged in `attention_later` their attention's in the MLP segment (of the layer below), and
    `vocab_later` rows of each rank's vocabulary computing theirs in the attention backward's spans,
    a layer's worth in each."""
    segs = [segments(p, dims, *share) for p, share in zip(profiles, shares)]
    moved, deferred = zip(*(later_products(p, dims, share, bool(later and later[i]),
                                           bool(attention_later and attention_later[i]))
                            for i, (p, share) in enumerate(zip(profiles, shares))))
    spread = [vocab_later_seconds(p, dims, vocab_later[i] if vocab_later else 0) for i, p in enumerate(profiles)]
    backs = [attention_backward_seconds(p, share[0]) - d for p, share, d in zip(profiles, shares, deferred)]
    overflow = max(b + w + x / dims.num_layers for b, w, x in zip(backs, moved, spread)) - max(backs)
    coll = max(collective_seconds(p, dims) for p in profiles) if len(profiles) > 1 else 0.0
    coll += max(shared_grad_seconds(p, dims, shared_groups) for p in profiles)
    attention = max(s[0] - d for s, d in zip(segs, deferred)) + overflow
    mlp = max(s[1] - w + d for s, w, d in zip(segs, moved, deferred))
    return dims.num_layers * (attention + mlp) + max(s[2] - x for s, x in zip(segs, spread)) + coll


def split_step_seconds(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit) -> float:
    """Predicted step of participants `profiles` (rank order) holding `split`."""
    return step_seconds(profiles, dims, split.shares(), len(split.shared_kv_groups), split.weight_grads_later,
                        split.attention_weight_grads_later, split.vocab_rows_later)


def unit_bytes(dims: ModelDims, micro_batch: int, seq_len: int) -> tuple[float, float, float, float]:
    """(fixed, per KV group, per MLP block, per vocabulary block) bytes: parameters with their
    gradients and AdamW moments, plus the activations autograd keeps for the backward."""
    h, hd, hpg, layers = dims.hidden_size, dims.head_dim, dims.heads_per_group, dims.num_layers
    tokens = micro_batch * seq_len
    norms = (2 * layers + 1) * h
    fixed = RUNTIME_BYTES + BYTES_PER_PARAM * norms + 4 * tokens * h * (6 * layers + 4)
    kv_params = layers * (2 * hpg * hd * h + 2 * hd * h)
    kv_acts = layers * 4 * (tokens * (hpg + 2) * hd * 3 + micro_batch * hpg * seq_len * seq_len)
    mlp_params = layers * 3 * h * dims.mlp_block
    mlp_acts = layers * 4 * tokens * dims.mlp_block * 4
    tied = 1 if dims.tie_word_embeddings else 2
    vocab_params = tied * h * dims.vocab_block
    vocab_acts = 4 * tokens * dims.vocab_block * 3
    return (
        fixed,
        BYTES_PER_PARAM * kv_params + kv_acts,
        BYTES_PER_PARAM * mlp_params + mlp_acts,
        BYTES_PER_PARAM * vocab_params + vocab_acts,
    )


def _units(dims: ModelDims) -> tuple[int, int, int]:
    return dims.num_kv_heads, dims.intermediate_size // dims.mlp_block, dims.vocab_size // dims.vocab_block


class Later(NamedTuple):
    """Per participant: whether its MLP's, and whether its attention's, weight gradients come later, and
    how many of its vocabulary blocks' do (None: none)."""

    mlp: list[bool]
    attention: list[bool]
    vocab: list[int] | None = None

    def select(self, members: list[int]) -> "Later":
        return Later([self.mlp[i] for i in members], [self.attention[i] for i in members],
                     [self.vocab[i] for i in members] if self.vocab else None)


def _to_split(dims: ModelDims, g: list, m: list[int], v: list[int], later: Later | None = None) -> ShardSplit:
    """Blocks to sizes; a tail that is not a whole block goes to the device with the most blocks.
    `g`: attention shares (see `Share`), or plain KV group counts; `later`: per rank, whether its
    MLP's and its attention's weight gradients come later (None: no rank's)."""
    g = [share if isinstance(share, tuple) else (share, None) for share in g]
    mlp = [b * dims.mlp_block for b in m]
    vocab = [b * dims.vocab_block for b in v]
    mlp[max(range(len(m)), key=lambda i: (m[i], -i))] += dims.intermediate_size - sum(mlp)
    vocab[max(range(len(v)), key=lambda i: (v[i], -i))] += dims.vocab_size - sum(vocab)
    rows = [r for _, r in g] if any(r is not None for _, r in g) else None
    vocab_later = ([min(b * dims.vocab_block, rows_i) for b, rows_i in zip(later.vocab, vocab)]
                   if later and later.vocab and any(later.vocab) else None)
    return ShardSplit(kv_groups=[k for k, _ in g], kv_rows=rows, mlp_columns=mlp, vocab_rows=vocab,
                      weight_grads_later=list(later.mlp) if later and any(later.mlp) else None,
                      attention_weight_grads_later=list(later.attention) if later and any(later.attention) else None,
                      vocab_rows_later=vocab_later).check(dims)


# -- the solver ----------------------------------------------------------------------


MILP_OPTIONS = {"time_limit": 0.5}
"""HiGHS per participant set; a set that hits the limit keeps its best integer solution."""
PLAN_BUDGET_SECONDS = 3.0
"""When memory binds for many devices, stop trying further participant sets after this long."""


def _solve_with_memory(profiles, dims, micro_batch, seq_len, members: list[int], relax: bool = False):
    """The same problem for a fixed participant set, with each device's memory limit, by HiGHS.

    Only needed when the water-filled split does not fit; returns (step, collectives, g, m, v,
    None: no weight gradients later, this program leaves them out, proven optimal), or None when
    the devices cannot hold the model. With `relax`, the LP relaxation: its step is a lower bound, in
    seconds. A binary per device and component says whether it pays that component's fixed
    cost; with fixed costs many memory-bound devices can take HiGHS past MILP_OPTIONS' limit
    (the plan then says `optimal: false`).
    """
    k, layers = len(members), dims.num_layers
    units = _units(dims)
    costs = [unit_costs(profiles[i]) for i in members]
    fixed_b, kv_b, mlp_b, vocab_b = unit_bytes(dims, micro_batch, seq_len)
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
        add({i: kv_b / gib, k + i: mlp_b / gib, 2 * k + i: vocab_b / gib}, -np.inf,
            (profiles[members[i]].memory_bytes - fixed_b) / gib)
    objective = np.zeros(n_vars)
    objective[T] = [layers, layers, 1]
    integrality = np.r_[np.zeros(6 * k) if relax else np.ones(6 * k), np.zeros(3)]
    upper = np.r_[np.repeat(units, k), np.ones(3 * k), [np.inf] * 3]
    res = milp(objective, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(n_vars), upper), options=MILP_OPTIONS)
    if res.x is None:
        return None
    x = np.round(res.x[: 3 * k]).astype(int).tolist()
    coll = max(collective_seconds(profiles[i], dims) for i in members) if k > 1 else 0.0
    return res.fun + coll, coll, [(g, None) for g in x[:k]], x[k : 2 * k], x[2 * k :], None, res.status == 0


def water_fill(costs: list[Segment], units: int) -> tuple[float, list[int]]:
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


Share = tuple[int, tuple[int, int] | None]
"""One rank's attention: (KV groups, None) or (1, (r0, r1)): rows r0..r1 of a shared group."""


def attention_layout(costs: list[Segment], groups: int, rows: int, layers: int,
                     share_seconds: float, bound: float = float("inf")) -> tuple[float, list[Share]]:
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
        moves = []
        if taken == 0:
            moves += [(k, (g + k, 0), 0, (k, None)) for k in range(groups - g + 1)]
            if g < groups:
                moves += [(r / rows, (g, r), 1, (1, (0, r))) for r in range(1, rows)]
        else:
            moves += [(r / rows, (g + 1, 0) if taken + r == rows else (g, taken + r), 0,
                       (1, (taken, taken + r))) for r in range(1, rows - taken + 1)]
        found = []
        for units, state, new_share, share in moves:
            mine = costs[i].seconds(units)
            if mine > bound * (1 + 1e-12):
                continue
            for slowest, shares, _, _ in front(i + 1, *state):
                found.append((max(mine, slowest), shares + new_share, share, (state, shares)))
        found.sort(key=lambda e: (e[0], e[1]))
        pruned = []
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

    @classmethod
    def of(cls, p: DeviceProfile, room: float, extra: float = 0.0) -> "MlpCost":
        return cls(unit_costs(p)[1], weight_grad_costs(p)[0], room, extra)

    def moved(self, units: float) -> float:
        """Seconds moved out of the segment with `units` blocks (0: they do not fit, or there are none)."""
        seconds = self.weight_grads.seconds(units)
        return seconds if 0 < seconds <= self.room else 0.0

    def seconds(self, units: float) -> float:
        return self.mlp.seconds(units) - self.moved(units) + self.extra


def _mlp_costs(profiles: list[DeviceProfile], attention_units: list[float] | None,
               deferred: list[float] | None = None) -> list[MlpCost]:
    """Each device's MLP cost beside these attention shares, of which each device defers `deferred`
    seconds of weight-gradient products to its MLP segment (None: room without limit, a lower bound)."""
    if attention_units is None:
        return [MlpCost.of(p, float("inf")) for p in profiles]
    deferred = deferred or [0.0] * len(profiles)
    backs = [attention_backward_seconds(p, a) - d for p, a, d in zip(profiles, attention_units, deferred)]
    # a device defers one of the two at most: its attention's products to the MLP segment, or its
    # MLP's to the attention's (a deferring device gets no room)
    return [MlpCost.of(p, 0.0 if d > 0 else max(backs) - b, d) for p, b, d in zip(profiles, backs, deferred)]


def _mlp_split(costs: list[MlpCost], blocks: int) -> tuple[float, list[int], list[bool]]:
    """Water-filled MLP blocks, and which devices' weight gradients come later."""
    tm, m = water_fill(costs, blocks)
    return tm, m, [c.moved(u) > 0 for c, u in zip(costs, m)]


class VocabCost(NamedTuple):
    """A device's vocabulary segment when the LM head weight-gradient products of up to `cap` of its
    blocks may leave it, a layer's worth into the room each attention backward span leaves it after
    its MLP's moves (so no span grows). Never decreases in units (a block still costs its seconds
    less its products), so water-filling with it stays exact."""

    vocab: Segment
    weight_grads: Segment
    cap: int

    @classmethod
    def of(cls, p: DeviceProfile, cap: int) -> "VocabCost":
        return cls(unit_costs(p)[2], weight_grad_costs(p)[1], cap)

    def later(self, units: float) -> int:
        return min(int(units), self.cap)

    def seconds(self, units: float) -> float:
        return self.vocab.seconds(units) - self.weight_grads.seconds(self.later(units))


def _vocab_beside(profiles: list[DeviceProfile], dims: ModelDims, rooms: list[float] | None, later: Later):
    """The vocabulary water-filled with each device's LM head products moved (by whole blocks) into the
    `rooms` its attention backward spans have left, per layer, after its MLP's moves (None: room without
    limit, a lower bound). Returns (seconds, blocks, `later` with the moves)."""
    blocks = _units(dims)[2]
    costs = []
    for i, p in enumerate(profiles):
        per_block = vocab_weight_grad_seconds(p, 1)
        if rooms is None:
            fits = blocks
        else:
            fits = min(blocks, int(dims.num_layers * rooms[i] / per_block * (1 + 1e-12))) if per_block > 0 and rooms[i] > 0 else 0
        costs.append(VocabCost.of(p, fits))
    tv, v = water_fill(costs, blocks)
    taken = [c.later(u) for c, u in zip(costs, v)]
    return tv, v, later._replace(vocab=taken if any(taken) else None)


def _attention_then_mlp(profiles: list[DeviceProfile], units: list[float], blocks: int):
    """Given each device's attention units: which devices defer their attention's weight gradients
    to the MLP segment, and the MLP split beside that. Returns (attention + MLP seconds per layer,
    MLP blocks, Later, each device's room left in its attention backward span after its MLP moves).

    Exact for these units, a device deferring one of its two components at most: deferring its
    attention helps only a device whose attention is the segment's longest (elsewhere it only
    lengthens its MLP and shortens the others' room), so some optimal choice defers exactly the
    devices above a level; each of the n + 1 levels is tried (with its exact MLP water-fill), no
    deferral first, so ties keep the plainer plan.
    """
    attention = [unit_costs(p)[0].seconds(u) for p, u in zip(profiles, units)]
    deferrable = [attention_weight_grad_seconds(p, u) for p, u in zip(profiles, units)]
    best = None
    levels = sorted({a for a, d in zip(attention, deferrable) if d > 0}, reverse=True)
    for level in [float("inf")] + levels[1:] + [-1.0]:  # nothing deferred, then the top device(s), ...
        defer = [a > level and d > 0 for a, d in zip(attention, deferrable)]
        deferred = [d if f else 0.0 for d, f in zip(deferrable, defer)]
        ta = max(a - d for a, d in zip(attention, deferred))
        costs = _mlp_costs(profiles, units, deferred)
        tm, m, mlp_later = _mlp_split(costs, blocks)
        if best is None or ta + tm < best[0] - 1e-12:
            best = (ta + tm, m, Later(mlp_later, defer), [c.room - c.moved(u) for c, u in zip(costs, m)])
    return best


def beside_attention(profiles: list[DeviceProfile], dims: ModelDims, units: list[float]):
    """Given each device's attention units (KV groups, a fraction where rows share one): the best MLP
    and vocabulary beside it (`_attention_then_mlp`, then `_vocab_beside`). Returns (the step's
    compute seconds, collectives apart; MLP blocks, vocabulary blocks, Later)."""
    seconds, m, later, rooms = _attention_then_mlp(profiles, units, _units(dims)[1])
    tv, v, later = _vocab_beside(profiles, dims, rooms, later)
    return dims.num_layers * seconds + tv, m, v, later


def best_split_with_attention(profiles: list[DeviceProfile], dims: ModelDims, kv_groups: list[int]) -> ShardSplit:
    """The best split for these devices (rank order) whose attention is `kv_groups` whole KV groups
    each: what the plan would pick beside a layout it did not choose (to price that layout)."""
    _, m, v, later = beside_attention(profiles, dims, kv_groups)
    return _to_split(dims, kv_groups, m, v, later)


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
        compute = [device_compute(p, dims, *share) for p, share in zip(profiles, _to_split(dims, g, m, v, later).shares())]
        return mean_idle_ratio(compute, step)

    return min(near, key=lambda o: (round(idle(o), 9), o[0]))


def _solve_members(profiles, dims, members: list[int], rows: int = 1, whole_groups: bool = False,
                   tolerance: float = 0.0):
    """The best split among exactly `members` (no memory limits), for micro-batches of `rows` rows:
    the vocabulary segment water-filled, the attention laid out by `attention_layout` (or
    water-filled in whole groups, and then only a lower bound when `rows` > 1), and the MLP
    water-filled beside that attention (its weight gradients may go where the attention leaves room).
    The attention's own split is the min-max one, the min-max one of what is left when every
    device defers its attention's weight gradients, or another partition of the groups
    (`attention_candidates`): the one that makes the shortest step or, with `tolerance`, the least
    idle one within it of the shortest (`least_idle`).
    Returns (step, collectives, attention shares, MLP blocks, vocabulary blocks, Later)."""
    G, MB, VB = _units(dims)
    part = [profiles[i] for i in members]
    attn = [unit_costs(p)[0] for p in part]
    ta, g = water_fill(attn, G)
    coll = max(collective_seconds(p, dims) for p in part) if len(members) > 1 else 0.0
    L = dims.num_layers
    kept = [attention_kept(p) for p in part]
    # no MLP or vocabulary is shorter than with all its weight gradients moved and none taken in
    tm_least, m, mlp_later = _mlp_split(_mlp_costs(part, None), MB)
    tv_least, v, moves = _vocab_beside(part, dims, None, Later(mlp_later, [False] * len(part)))
    if whole_groups and rows > 1 and len(members) > 1:
        # and row shares can only go as low as the fractional water level of the attention that no
        # deferral removes
        return L * (_fractional_level(kept, G) + tm_least) + tv_least + coll, coll, [(k, None) for k in g], m, v, moves
    g_kept = water_fill(kept, G)[1]
    options = []
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
    keys = np.array([(attn.floor, vocab.floor, collective_seconds(p, dims))
                     for p, (attn, _, vocab) in zip(profiles, map(unit_costs, profiles))])
    found, seen = {}, set()
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


def _fits(profiles, dims, micro_batch, seq_len, members, g, m, v) -> bool:
    fixed, kv_b, mlp_b, vocab_b = unit_bytes(dims, micro_batch, seq_len)
    return all(fixed + g[k][0] * kv_b + m[k] * mlp_b + v[k] * vocab_b <= profiles[i].memory_bytes
               for k, i in enumerate(members))


def plan_partition(profiles: list[DeviceProfile], dims: ModelDims, micro_batch: int, seq_len: int,
                   tolerance: float = IDLE_TOLERANCE) -> Plan:
    """The exact min-step plan over all devices (some may be left out, with a reason), or with
    `tolerance` its least idle attention layout within that of the shortest (`least_idle`).

    Each candidate participant set is solved exactly by water-filling each segment; when
    that split does not fit some device's memory, the set is solved by HiGHS with the
    memory constraints instead.
    """
    if not profiles:
        raise XronosError("no device profiles to plan with")
    n = len(profiles)
    best = None
    # the memory-free optimum of a set bounds its memory-bound one from below: solve the
    # sets in order of a lower bound of that (fractional attention when groups may be
    # shared by rows) and stop once it cannot beat the best (branch and bound)
    bounds = sorted(((_solve_members(profiles, dims, members, micro_batch, whole_groups=True)[0], members)
                     for members in _closed_sets(profiles, dims)), key=lambda bm: bm[0])
    optimal, started = True, time.perf_counter()
    for lower, members in bounds:
        if best is not None and lower >= best[0] - 1e-12:
            break
        step, coll, g, m, v, later = _solve_members(profiles, dims, members, micro_batch, tolerance=tolerance)
        if best is not None and step >= best[0] - 1e-12:
            continue
        if not _fits(profiles, dims, micro_batch, seq_len, members, g, m, v):
            if best is not None and time.perf_counter() - started > PLAN_BUDGET_SECONDS:
                optimal = False  # sets left untried
                break
            bound = _solve_with_memory(profiles, dims, micro_batch, seq_len, members, relax=True)
            if bound is None or (best is not None and bound[0] >= best[0] - 1e-12):
                continue  # cannot hold the model, or cannot beat the best even fractionally
            solved = _solve_with_memory(profiles, dims, micro_batch, seq_len, members)
            if solved is None:
                continue  # these devices cannot hold the model together
            step, coll, g, m, v, later, proven = solved
            optimal &= proven
        if best is None or step < best[0] - 1e-12:
            best = (step, coll, members, g, m, v, later)
    if best is None:
        raise XronosError("no device, nor any group of devices, has the memory for this model at these shapes")
    step, coll, members, g, m, v, later = best
    full = lambda part, none=0: [part[members.index(i)] if i in members else none for i in range(n)]  # noqa: E731
    y = [1 if i in members else 0 for i in range(n)]
    plan = _explain(profiles, dims, micro_batch, seq_len, full(g, (0, None)), full(m), full(v), y, coll,
                    Later(full(later.mlp, False), full(later.attention, False),
                          full(later.vocab) if later.vocab else None) if later else None)
    return plan if optimal else plan.model_copy(update={"optimal": False})


def _explain(profiles, dims, micro_batch, seq_len, g, m, v, y, coll, later=None) -> Plan:
    members = [i for i in range(len(profiles)) if y[i]]
    split = _to_split(dims, [g[i] for i in members], [m[i] for i in members], [v[i] for i in members],
                      later.select(members) if later else None)
    fixed_bytes, kv_bytes, mlp_bytes, vocab_bytes = unit_bytes(dims, micro_batch, seq_len)
    devices, shares = [], split.shares()
    for i, p in enumerate(profiles):
        if i not in members:
            if fixed_bytes + min(kv_bytes, mlp_bytes, vocab_bytes) > p.memory_bytes:
                reason = f"too little memory: {p.memory_bytes / 2**20:.0f} MiB free, a share needs more"
            else:
                reason = "too slow: its share would save less than it adds to every collective"
            devices.append(DeviceCost(device=p.device, rank=None, kv_groups=0, mlp_columns=0, vocab_rows=0,
                                      compute_seconds=0.0, memory_bytes=0, reason=reason))
            continue
        rank = members.index(i)
        kv, mlp, vocab = split.kv_groups[rank], split.mlp_columns[rank], split.vocab_rows[rank]
        memory = fixed_bytes + kv * kv_bytes + mlp / dims.mlp_block * mlp_bytes + vocab / dims.vocab_block * vocab_bytes
        devices.append(DeviceCost(device=p.device, rank=rank, kv_groups=kv, 
                                  kv_rows=split.kv_rows[rank] if split.kv_rows else None,
                                  mlp_columns=mlp, vocab_rows=vocab, compute_seconds=device_compute(p, dims, *shares[rank]),
                                  memory_bytes=int(memory)))
    step = split_step_seconds([profiles[i] for i in members], dims, split)
    coll = coll if len(members) > 1 else 0.0
    compute = [d.compute_seconds for d in devices if d.rank is not None]  # rank order = device order
    idle = idle_seconds(compute)
    devices = [d if d.rank is None else d.model_copy(update={"idle_seconds": idle[d.rank]}) for d in devices]
    return Plan(split=split, devices=devices, collective_seconds=coll, predicted_step_seconds=step,
                predicted_idle_ratio=mean_idle_ratio(compute, step))


def recalibrate(profile: DeviceProfile, factor: float, per_segment: dict[str, float] | None = None) -> DeviceProfile:
    """The profile with its compute seconds scaled by measured / predicted compute (`factor`), and
    the seconds of each segment in `per_segment` (by split dimension, see SEGMENT_FIELDS) by its own.

    A device in a real job can run faster or slower than its micro-benchmark said
    (contention, thermal limits; under an emulated CPU quota, a device that waits
    often in collectives gets its quota back and computes faster), and a short
    micro-benchmark can misjudge one component more than another. Its collective
    cost is left as measured.
    """
    scaled = {k: getattr(profile, k) * factor for k in COMPUTE_FIELDS}
    for dim, own in (per_segment or {}).items():
        scaled |= {k: getattr(profile, k) * own for k in SEGMENT_FIELDS[dim]}
    return profile.model_copy(update=scaled)


class MeasuredCompute(NamedTuple):
    """One rank's compute seconds per micro-step in a job: in all, and of that, in the attention and MLP
    segments of all its layers and in the vocabulary's (SEGMENT_FIELDS' order; as `edge_node.tp.comm`
    times them; 0: not measured)."""

    total: float
    segments: tuple[float, float, float] = (0.0, 0.0, 0.0)


def segment_compute(p: DeviceProfile, dims: ModelDims, share: tuple[float, float, float],
                    mlp_later: bool = False, attention_later: bool = False,
                    vocab_later: int = 0) -> tuple[float, float, float]:
    """A device's predicted compute per micro-step in the attention and MLP segments of all layers and
    in the vocabulary segment, for a share: weight-gradient products counted where they run (moved MLP
    products and `vocab_later` rows' LM head products in the attention's backward spans, deferred
    attention products in the MLP segment)."""
    attention, mlp, vocab = segments(p, dims, *share)
    moved, deferred = later_products(p, dims, share, mlp_later, attention_later)
    spread = vocab_later_seconds(p, dims, vocab_later)
    return (dims.num_layers * (attention - deferred + moved) + spread, dims.num_layers * (mlp - moved + deferred),
            vocab - spread)


def calibration_factors(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit,
                        measured: list[MeasuredCompute]) -> list[tuple[float, dict[str, float]]]:
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
        parts = segment_compute(p, dims, share, *(split.rank_computes_weight_grads_later(dim, r)
                                                  for dim in ("mlp_columns", "kv_groups")), split.vocab_later(r))
        held = [u > 0 and x > 0 and y > 0 for u, x, y in zip(share, parts, seen.segments)]
        logs.append([float(np.log(y / x)) if h else None for h, x, y in zip(held, parts, seen.segments)])
        weights.append([x if h else 0.0 for h, x in zip(held, parts)])
    means = [np.mean(known) if (known := [row[c] for row in logs if row[c] is not None]) else 0.0
             for c in range(len(SEGMENT_FIELDS))]
    factors = []
    for f, row, w in zip(whole, logs, weights):
        rel = {dim: x - mean for dim, x, mean in zip(SEGMENT_FIELDS, row, means) if x is not None}
        centre = sum(w[c] * (x - means[c]) for c, x in enumerate(row) if x is not None) / sum(w) if rel else 0.0
        factors.append((f, {dim: f * float(np.exp(x - centre)) for dim, x in rel.items()}))
    return factors


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


def min_replan_gain(kept_gain: float | None, reshard_seconds: float | None, step_seconds: float,
                    steps_left: int) -> float:
    """The predicted gain a check needs to re-shard: MIN_REPLAN_GAIN, or CONFIRMED_REPLAN_GAIN when the
    check before kept the split though it found a gain of at least that much (whichever split it was;
    `kept_gain`; None: it re-sharded, or there was none), raised to what pays back a re-shard's seconds
    (`reshard_seconds`, the last one's, when one has been timed, not counting the warm-up steps after
    it) over the steps left, and never above MIN_REPLAN_GAIN (which re-shards regardless)."""
    if kept_gain is None or kept_gain < CONFIRMED_REPLAN_GAIN:
        return MIN_REPLAN_GAIN
    payback = reshard_seconds / (step_seconds * steps_left) if reshard_seconds and steps_left > 0 and step_seconds > 0 else 0.0
    return min(MIN_REPLAN_GAIN, max(CONFIRMED_REPLAN_GAIN, payback))


class Replan(NamedTuple):
    """A re-plan's outcome: the split to run (the same one when kept), the profiles recalibrated
    towards the measurement, what the profiles before predicted per rank, and how much shorter the
    best split's step is than the current one's by the recalibrated profiles (0: none better)."""

    split: ShardSplit
    profiles: list[DeviceProfile]
    predicted: list[float]
    gain: float


def replan(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit, measured: list[MeasuredCompute],
           micro_batch: int, seq_len: int, min_gain: float = MIN_REPLAN_GAIN,
           tolerance: float = IDLE_TOLERANCE) -> Replan:
    """A new split for the same ranks from measured compute seconds per micro-step (rank order),
    the profiles recalibrated towards the measurement (the next re-plan starts from them,
    so repeated re-plans converge on the measured pace), and what `profiles` predicted.
    The split moves only for a predicted gain of at least `min_gain` (the split it would move to: with
    `tolerance`, the least idle layout within it of the shortest, `least_idle`).

    The ranks stay the ranks (the process group is fixed), so every device keeps taking part.
    """
    predictions = [device_compute(p, dims, *share) for p, share in zip(profiles, split.shares())]
    # Most of the way (geometrically) towards the measurement, not all: a device's pace depends
    # on its share (under a CPU quota, the less it waits the slower it computes).
    calibrated = [recalibrate(p, f ** RECALIBRATION_STEP, {dim: x ** RECALIBRATION_STEP for dim, x in own.items()})
                  for p, (f, own) in zip(profiles, calibration_factors(profiles, dims, split, measured))]
    members = list(range(len(profiles)))
    step, coll, g, m, v, later = _solve_members(calibrated, dims, members, micro_batch, tolerance=tolerance)
    if not _fits(calibrated, dims, micro_batch, seq_len, members, g, m, v):
        solved = _solve_with_memory(calibrated, dims, micro_batch, seq_len, members)
        if solved is None:
            return Replan(split, profiles, predictions, 0.0)
        step, _, g, m, v, later, _ = solved
    current = split_step_seconds(calibrated, dims, split)
    gain = max(0.0, 1 - step / current) if current > 0 else 0.0
    if gain < min_gain:  # not worth a re-shard (and measurement noise would drive it)
        return Replan(split, calibrated, predictions, gain)
    return Replan(_to_split(dims, g, m, v, later), calibrated, predictions, gain)
