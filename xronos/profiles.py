"""A device's measured speed at a job's shapes: what the partitioner plans with.

Seconds, not FLOP estimates: every number is timed on the device itself,
under whatever CPU share it really has. Units match the split: one KV group,
one block of MLP columns and one block of vocabulary rows, each costed for
forward + backward + the AdamW update of its parameters, in one layer (the
vocabulary has no layers). Travels as JSON (a profile file, an MQTT message).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt


class ProfileShape(BaseModel):
    """What a profile was measured at; a cached profile is reused only for the same shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: PositiveInt
    head_dim: PositiveInt
    heads_per_group: PositiveInt
    micro_batch: PositiveInt
    seq_len: PositiveInt
    mlp_block: PositiveInt
    vocab_block: PositiveInt
    threads: PositiveInt


class DeviceProfile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    device: str = Field(description="Node id (or 'device-<i>' in a local run).")
    speed_hint: float | None = Field(None, description="The emulated speed, when there is one (informational).")
    shape: ProfileShape
    kv_group_seconds: NonNegativeFloat
    mlp_block_seconds: NonNegativeFloat
    vocab_block_seconds: NonNegativeFloat
    layer_fixed_seconds: NonNegativeFloat = Field(description="Replicated work per layer (norms, residuals).")
    step_fixed_seconds: NonNegativeFloat = Field(description="Replicated work per micro-step outside the layers.")
    allreduce_latency_seconds: NonNegativeFloat
    allreduce_seconds_per_mib: NonNegativeFloat = Field(description="This device's CPU cost of an all-reduce, per MiB.")
    memory_bytes: PositiveInt = Field(description="Memory the device can give to the job.")
    address: str | None = None
    profile_seconds: NonNegativeFloat = 0.0
