"""The MQTT wire contract (docs/control-plane.md, docs/schema/): one pydantic model per message, one place binding topics.

Every payload is JSON with a `schema_version`. `Topic.decode` is the only way
bytes become a message: anything malformed (not JSON, wrong schema or version,
oversized, an id that is not `[A-Za-z0-9_-]+`) raises `WireError`, which a
long-running process logs, counts and drops; it never stops the process.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from xronos.contract.assignment import RankAssignment
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import RankResult, RunReport
from xronos.contract.splits import ModelDims, ShardSplit

ROOT = "xronos"
MAX_PAYLOAD_BYTES = 256 * 1024
"""Larger payloads are dropped unread: no message of the contract comes near it."""

RESULT_PART_BYTES = 128 * 1024
"""A node's result over this is sent in parts of at most this: half the limit, room for the envelope."""
MAX_RESULT_PARTS = 100_000
"""Parts of one result: 12 GiB at most, a 10-million-step job (MAX_STEPS) with room to spare."""
PER_STEP_FIELDS = ("losses", "step_seconds", "comm_seconds", "segment_seconds")
"""The RankResult series that grow with the job; a result's parts split these and repeat the rest."""

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
Id = Annotated[str, StringConstraints(pattern=ID_PATTERN)]


def valid_id(text: str) -> bool:
    """Node and job ids are topic levels: no '/', '+', '#' or anything else that would change a topic."""
    return re.fullmatch(ID_PATTERN, text) is not None


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
    loss: float | None = None
    step_seconds: float | None = Field(None, ge=0, description="Wall time of the step named by `step`.")
    checkpoint: int | None = Field(
        None,
        ge=0,
        description="The newest sealed checkpoint step this node holds for the job in flight (None: none): "
        "where the job can resume on this node if a peer is lost. Read from a directory listing, not verified.",
    )


class ProfileMessage(_Message):
    """A node's measured speed, retained: at the default shape on start, at a job's shapes when asked."""

    node_id: Id
    profile: DeviceProfile
    job_id: Id | None = Field(None, description="The job whose shapes were measured (None: the start-up profile).")
    dims: ModelDims | None = Field(
        None, description="The job's model sizes, read by the node from its copy of the model."
    )
    rendezvous_port: int | None = Field(
        None, ge=1, le=65535, description="A free port for the job's rendezvous, if rank 0."
    )
    attempt: float | None = Field(
        None, description="The `ts` of the profile assignment it answers (a job resumed after a node loss asks again)."
    )


class Assignment(RankAssignment, _Message):
    """A node's part in a job, written by the controller only (retained; cleared when the job ends).

    Phase `profile` asks the node to measure itself at the job's shapes; phase `train`
    gives its rank (None: the plan leaves it out), shard and the rendezvous: the fields
    of `RankAssignment`, flat, and checked as it checks them.
    """

    job_id: Id
    node_id: Id
    phase: Literal["profile", "train"]
    job: JobOptions

    @model_validator(mode="after")
    def _no_rank_to_profile(self) -> Assignment:
        if self.phase == "profile" and self.rank is not None:
            raise ValueError("a profile assignment gives no rank")
        return self

    def rank_assignment(self) -> RankAssignment:
        """The fields that the node's worker needs, as the worker reads them."""
        return RankAssignment.model_validate(self.model_dump(include=set(RankAssignment.model_fields)))


class NodeResult(_Message):
    """What a node measured in a job (or why it failed), retained until its next job.

    A result grows with the job (about 115 bytes a step); one over RESULT_PART_BYTES goes as
    `parts` messages (`result_parts`), each with a run of every per-step series, which the
    controller joins (`join_result_parts`) before it builds the report from the whole series.
    """

    job_id: Id
    node_id: Id
    ok: bool
    result: RankResult | None = None
    error: str | None = None
    part: int = Field(0, ge=0, description="Which part of the result this message holds (from 0).")
    parts: int = Field(
        1, ge=1, le=MAX_RESULT_PARTS, description="How many messages the result takes (a long job's is split)."
    )
    attempt: float | None = Field(
        None,
        description="The `ts` of the profile assignment the node's part began with: a job resumed after a node "
        "loss starts a new attempt, and results of an earlier one are not its own.",
    )

    @model_validator(mode="after")
    def _part_in_parts(self) -> NodeResult:
        if self.part >= self.parts:
            raise ValueError(f"part {self.part} of a result in {self.parts} parts")
        if self.parts > 1 and self.result is None:
            raise ValueError("only a result with measurements is split into parts")
        return self


def result_parts(
    job_id: str, node_id: str, result: RankResult, part_bytes: int = RESULT_PART_BYTES, attempt: float | None = None
) -> list[NodeResult]:
    """A node's result as messages of at most `part_bytes` each: one when it fits, else runs of the
    per-step series (PER_STEP_FIELDS) in order, the other fields repeated (the re-plan checks, at
    most a few, and the timeline in the first part only)."""
    whole = NodeResult(job_id=job_id, node_id=node_id, ok=True, result=result, attempt=attempt)
    size = len(RESULT.encode(whole))
    if size <= part_bytes:
        return [whole]
    parts = -(-size // part_bytes)
    while parts <= MAX_RESULT_PARTS:
        messages = [
            NodeResult(
                job_id=job_id,
                node_id=node_id,
                ok=True,
                part=i,
                parts=parts,
                attempt=attempt,
                result=result.model_copy(
                    update={
                        **{f: _run_of(getattr(result, f), i, parts) for f in PER_STEP_FIELDS},
                        "replans": result.replans if i == 0 else [],
                        "timeline": result.timeline if i == 0 else [],
                    }
                ),
            )
            for i in range(parts)
        ]
        if all(len(RESULT.encode(m)) <= part_bytes for m in messages):
            return messages
        parts *= 2
    raise WireError(f"a result of {size:,} bytes does not fit in {MAX_RESULT_PARTS:,} parts of {part_bytes:,}")


def _run_of(series: list, i: int, parts: int) -> list:
    """The i-th of `parts` consecutive runs of `series` (the first ones one longer when it does not divide)."""
    size, extra = divmod(len(series), parts)
    start = i * size + min(i, extra)
    return series[start : start + size + (i < extra)]


def join_result_parts(parts: list[NodeResult]) -> RankResult:
    """The result that `result_parts` split, from all its parts (in any order, each once)."""
    ordered = sorted(parts, key=lambda m: m.part)
    if [m.part for m in ordered] != list(range(ordered[0].parts)) or any(m.result is None for m in ordered):
        raise WireError(f"a result's parts {[m.part for m in ordered]} are not 0..{ordered[0].parts - 1}")
    results = [m.result for m in ordered if m.result is not None]
    return results[0].model_copy(
        update={f: [x for r in results for x in getattr(r, f)] for f in PER_STEP_FIELDS}
        | {"replans": [c for r in results for c in r.replans], "timeline": [e for r in results for e in r.timeline]}
    )


class TrainCommand(_Message):
    job_id: Id
    job: JobOptions
    nodes: list[Id] | None = Field(None, description="Named nodes; None = every idle online node.")


class StopCommand(_Message):
    job_id: Id


MAX_RECOVERIES = 16
"""Resumptions of one job after node losses; beyond, a loss fails it (a fleet is tens of devices)."""


class Recovery(BaseModel):
    """A job going on after losing nodes: re-planned on the others, resumed from its last checkpoint."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lost: list[Id] = Field(min_length=1, description="The nodes it lost.")
    reason: str = Field(max_length=2000, description="How the loss showed (a will, silence, a worker killed).")
    at_step: int = Field(ge=0, description="The newest step the job had reached when the loss was noticed.")
    resumed_from: int = Field(
        ge=0, description="The checkpoint step it goes on from (0: from the start, there was no checkpoint yet)."
    )
    nodes: list[Id] = Field(min_length=1, description="The nodes it goes on with (re-planned from their profiles).")
    ts: float = Field(default_factory=time.time)

    def describe(self) -> str:
        lost = max(0, self.at_step - self.resumed_from)
        start = f"the checkpoint of step {self.resumed_from}" if self.resumed_from else "step 0: no checkpoint yet"
        return (
            f"resumed on {len(self.nodes)} node{'s' * (len(self.nodes) != 1)} after losing {', '.join(self.lost)} "
            f"at step {self.at_step}; {lost} step{'s' * (lost != 1)} lost (from {start})"
        )


class JobStatus(_Message):
    job_id: Id
    state: Literal["planning", "running", "completed", "failed", "stopped"]
    recoveries: list[Recovery] = Field(
        [], max_length=MAX_RECOVERIES, description="Node losses the job survived, oldest first (`Recovery`)."
    )
    step: int | None = None
    loss: float | None = None
    steps: int | None = None
    nodes: list[Id] = []
    split: ShardSplit | None = None
    stages: list[tuple[int, int]] | None = None
    reason: str | None = None
    output: str | None = Field(None, description="Where the model was written: '<node id>:<directory>'.")
    report: RunReport | None = None

    @property
    def finished(self) -> bool:
        return self.state in ("completed", "failed", "stopped")


class ControllerStatus(_Message):
    """The live controller, retained: `online` at connect and every few seconds, `offline` as its last will.

    A starting controller reads it before it connects under the controller's identity, and
    refuses to start while another one is live (docs/control-plane.md).
    """

    state: Literal["online", "offline"]
    instance: Id = Field(description="Random per controller process: tells two controllers apart.")
    started: float = Field(description="When this controller started, seconds since the epoch.")
    host: str | None = Field(None, max_length=255, description="The host name it runs on.")
    pid: int | None = Field(None, ge=1, description="Its process id there.")


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

    @property
    def family(self) -> str:
        """The family's name below the root with '+' for the id: how dropped messages are counted."""
        return self.pattern.replace("{}", "+")

    def encode(self, message: M) -> bytes:
        return message.model_dump_json().encode()

    def ident(self, topic: str) -> str | None:
        """The node or job id in a concrete topic name of this family (None if it is not one)."""
        if "{}" not in self.pattern:
            return "" if topic == self.name() else None
        head, _, tail = self.pattern.partition("{}")
        prefix, suffix = f"{ROOT}/{head}", tail
        if not (topic.startswith(prefix) and topic.endswith(suffix)) or len(topic) <= len(prefix) + len(suffix):
            return None
        ident = topic[len(prefix) : len(topic) - len(suffix)] if suffix else topic[len(prefix) :]
        return ident if "/" not in ident else None

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
RESULT = Topic("nodes/{}/result", NodeResult, qos=1, retain=True)
JOB_STATUS = Topic("jobs/{}/status", JobStatus, qos=1, retain=True)
TRAIN = Topic("cmd/train", TrainCommand, qos=1, retain=False)
STOP = Topic("cmd/stop", StopCommand, qos=1, retain=False)
CONTROLLER_STATUS = Topic("controller/status", ControllerStatus, qos=1, retain=True)

TOPICS = (NODE_STATUS, HEARTBEAT, PROFILE, ASSIGNMENT, RESULT, JOB_STATUS, TRAIN, STOP, CONTROLLER_STATUS)


def json_schemas() -> dict[str, dict]:
    """The published form of the contract: each topic's message as JSON Schema, by file name.

    Each schema also says where its message goes (`x-xronos-topic`, `-qos`, `-retain`), so
    a Node-RED flow or a Home Assistant automation can be written from the files alone.
    """
    out = {}
    for topic in TOPICS:
        schema = topic.model.model_json_schema()
        out[f"{topic.model.__name__}.json"] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema,
            "x-xronos-topic": topic.subscription(),
            "x-xronos-qos": topic.qos,
            "x-xronos-retain": topic.retain,
        }
    return out
