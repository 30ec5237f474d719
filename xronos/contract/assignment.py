"""`RankAssignment`: a device's part in a training run, declared once.

The same facts travel three ways: in the controller's MQTT assignment to a node
(`wire.Assignment` embeds these fields, flat, as its published schema has them),
in the plan file `xronos run` or the node agent hands a profiled worker, and in
the worker's spec when the rank is known at start. One model, so one validation:
an assignment that contradicts itself (a rank outside its world, a split or
stages for another number of ranks) is rejected when it is decoded, never when a
worker indexes a list with it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xronos.contract.profiles import DeviceProfile
from xronos.contract.splits import ShardSplit


class RankAssignment(BaseModel):
    """A device's rank (None: the plan leaves it out), its shard, and the job's rendezvous."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int | None = Field(None, ge=0)
    world_size: int | None = Field(None, ge=1)
    master_addr: str | None = Field(None, max_length=253)
    master_port: int | None = Field(None, ge=1, le=65535)
    split: ShardSplit | None = Field(None, description="Tensor-parallel modes: every rank's shard sizes.")
    stages: list[tuple[int, int]] | None = Field(None, description="Pipeline mode: layers [lo, hi) of each rank.")
    micro_batches: int = Field(1, ge=1, description="Pipeline mode: micro-batches per step.")
    profiles: list[DeviceProfile] | None = Field(
        None, description="Mode xronos: the participants' profiles in rank order, for re-planning."
    )
    plain: bool = Field(
        False,
        description="Train the plain Hugging Face model on this one rank (mode xronos chose the fastest device "
        "alone: the job is shorter without spreading it).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> RankAssignment:
        if self.rank is None:
            return self
        if self.world_size is None or self.master_addr is None or self.master_port is None:
            raise ValueError("a rank's assignment needs world_size, master_addr and master_port")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if (self.split is None) == (self.stages is None):
            raise ValueError("a rank's assignment needs a split (tensor parallel) or stages (pipeline), not both")
        if self.split is not None and self.split.world_size != self.world_size:
            raise ValueError(f"the split is for {self.split.world_size} ranks, the world size {self.world_size}")
        if self.stages is not None:
            if len(self.stages) != self.world_size:
                raise ValueError(f"{len(self.stages)} stages for world size {self.world_size}")
            bounds = [lo for lo, _ in self.stages] + [self.stages[-1][1]]
            if (
                bounds[0] != 0
                or any(lo > hi for lo, hi in self.stages)
                or any(a[1] != b[0] for a, b in zip(self.stages, self.stages[1:]))
            ):
                raise ValueError(f"stages {self.stages} are not consecutive layer ranges from layer 0")
        if self.profiles is not None and len(self.profiles) != self.world_size:
            raise ValueError(f"{len(self.profiles)} profiles for world size {self.world_size}")
        if self.plain and (self.world_size != 1 or self.split is None):
            raise ValueError("a plain model trains on one rank with its whole split")
        return self
