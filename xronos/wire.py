"""The MQTT wire contract (DESIGN.md): one pydantic model per message, one place binding topics.

Every payload is JSON with a `schema_version`. `Topic.decode` is the only way
bytes become a message: anything malformed (not JSON, wrong schema or version,
oversized, an id that is not `[A-Za-z0-9_-]+`) raises `WireError`, which a
long-running process logs, counts and drops; it never stops the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from xronos.job import JobOptions
from xronos.profiles import DeviceProfile
from xronos.splits import ShardSplit

ROOT = "xronos"
MAX_PAYLOAD_BYTES = 256 * 1024
"""Larger payloads are dropped unread: no message of the contract comes near it."""

Id = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class WireError(ValueError):
    """A message that breaks the contract; log it, count it, drop it."""


class _Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    ts: float = Field(default_factory=time.time, description="Sender's clock, seconds since the epoch.")


class NodeStatus(_Message):
    """Retained birth (`online`) and last will (`offline`) of a node."""

    node_id: Id
    state: Literal["online", "offline"]


class Heartbeat(_Message):
    node_id: Id
    state: Literal["idle", "profiling", "training"]
    job_id: Id | None = None
    step: int | None = None


class ProfileMessage(_Message):
    node_id: Id
    profile: DeviceProfile


class Assignment(_Message):
    """A node's part in a job, written by the controller only (retained)."""

    job_id: Id
    node_id: Id
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    master_addr: str
    master_port: int = Field(ge=1, le=65535)
    split: ShardSplit
    job: JobOptions


class TrainCommand(_Message):
    job_id: Id
    job: JobOptions
    nodes: list[Id] | None = Field(None, description="Named nodes; None = every idle online node.")


class StopCommand(_Message):
    job_id: Id


class JobStatus(_Message):
    job_id: Id
    state: Literal["planning", "running", "completed", "failed", "stopped"]
    step: int | None = None
    loss: float | None = None
    split: ShardSplit | None = None
    reason: str | None = None
    report: dict | None = None


M = TypeVar("M", bound=_Message)


@dataclass(frozen=True)
class Topic(Generic[M]):
    """One topic family: its name pattern, message model, QoS and retain flag."""

    pattern: str  # with one '{}' for the node or job id, or none
    model: type[M]
    qos: int
    retain: bool

    def name(self, ident: str = "") -> str:
        return f"{ROOT}/{self.pattern.format(ident)}"

    def subscription(self) -> str:
        return f"{ROOT}/{self.pattern.format('+')}"

    def encode(self, message: M) -> bytes:
        return message.model_dump_json().encode()

    def decode(self, payload: bytes) -> M:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise WireError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
        try:
            return self.model.model_validate_json(payload)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "payload"
            raise WireError(f"invalid {self.model.__name__}: {where}: {first['msg']}") from None


NODE_STATUS = Topic("nodes/{}/status", NodeStatus, qos=1, retain=True)
HEARTBEAT = Topic("nodes/{}/heartbeat", Heartbeat, qos=0, retain=False)
PROFILE = Topic("nodes/{}/profile", ProfileMessage, qos=1, retain=True)
ASSIGNMENT = Topic("nodes/{}/assignment", Assignment, qos=1, retain=True)
JOB_STATUS = Topic("jobs/{}/status", JobStatus, qos=1, retain=True)
TRAIN = Topic("cmd/train", TrainCommand, qos=1, retain=False)
STOP = Topic("cmd/stop", StopCommand, qos=1, retain=False)

TOPICS = (NODE_STATUS, HEARTBEAT, PROFILE, ASSIGNMENT, JOB_STATUS, TRAIN, STOP)
