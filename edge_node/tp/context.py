"""`TPContext`: the state one tensor-parallel shard's modules share, in one object.

The collectives of a shard are timed on one clock (the trainer reads it per step,
the re-plan calibrates with its per-segment compute), run through one hub or the
ring, skip the ranks that hold none of a dimension, and the weight-gradient
products some layers defer wait in one queue that the next backward collective
drains. `parallelize` takes the context and gives it to every module and hook it
swaps in, and sets the holders from the split it applies, so a re-shard (a new
split, a new model) cannot leave the collectives with the old split's holders.
Nothing of it is process-wide: two shards in one process (a test, a profiler
beside a trainer) do not share a clock or a queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_node.tp.comm import CommClock, SocketStar
from edge_node.tp.weight_grads import WeightGradQueue


@dataclass
class TPContext:
    clock: CommClock = field(default_factory=CommClock)
    """Seconds in collectives and compute seconds per segment (`edge_node.tp.comm`)."""
    hub: int | None = None
    """The rank that sums the whole group's all-reduces (None: gloo's ring); chosen by the trainer
    (`Trainer.choose_collective`), the same on every rank."""
    star: SocketStar | None = None
    """The hub's own sockets to the other ranks, opened with the hub (`Trainer.choose_collective`); None:
    the hub's messages go through gloo (a test, a bench's comparison)."""
    holders: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """By split dimension: the ranks owning some of it (`ShardSplit.holders`); in the all-reduces that
    close its segments the other ranks' parts are zeros and are not sent. Set by `parallelize`."""
    weight_grads: WeightGradQueue = field(default_factory=WeightGradQueue)
    """Weight-gradient products run one backward collective later (`edge_node.tp.weight_grads`)."""
