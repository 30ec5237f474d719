"""The MQTT wire contract: every message round-trips; nothing malformed gets through."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile, ProfileShape
from xronos.contract.report import RankResult
from xronos.contract.splits import ModelDims, ShardSplit

ids = st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True)
counts = st.lists(st.integers(0, 10_000), min_size=1, max_size=4)
splits = st.integers(1, 4).flatmap(
    lambda n: st.builds(
        ShardSplit,
        kv_groups=st.lists(st.integers(0, 9), min_size=n, max_size=n),
        mlp_columns=st.lists(st.integers(0, 9999), min_size=n, max_size=n),
        vocab_rows=st.lists(st.integers(0, 99999), min_size=n, max_size=n),
    )
)
jobs = st.builds(
    JobOptions,
    model=st.text(min_size=1, max_size=20),
    data=st.text(min_size=1, max_size=20),
    output=st.text(min_size=1, max_size=20),
    steps=st.integers(1, 10**6),
    lr=st.floats(1e-7, 1.0),
)
secs = st.floats(0, 10, allow_nan=False)
shapes = st.builds(
    ProfileShape,
    hidden_size=st.integers(1, 8192),
    head_dim=st.integers(1, 256),
    heads_per_group=st.integers(1, 16),
    micro_batch=st.integers(1, 64),
    seq_len=st.integers(1, 8192),
    mlp_block=st.integers(1, 256),
    vocab_block=st.integers(1, 1024),
    threads=st.integers(1, 64),
)
profiles = st.builds(
    DeviceProfile,
    device=ids,
    shape=shapes,
    kv_group_seconds=secs,
    mlp_block_seconds=secs,
    vocab_block_seconds=secs,
    layer_fixed_seconds=secs,
    step_fixed_seconds=secs,
    kv_fixed_seconds=secs,
    mlp_fixed_seconds=secs,
    vocab_fixed_seconds=secs,
    allreduce_latency_seconds=secs,
    allreduce_seconds_per_mib=secs,
    memory_bytes=st.integers(1, 2**40),
)

dims = st.builds(
    ModelDims,
    hidden_size=st.integers(1, 8192),
    num_layers=st.integers(1, 100),
    num_heads=st.integers(1, 64),
    num_kv_heads=st.integers(1, 64),
    head_dim=st.integers(1, 256),
    intermediate_size=st.integers(1, 10**5),
    vocab_size=st.integers(1, 10**6),
    tie_word_embeddings=st.booleans(),
)

MESSAGES = {
    wire.NODE_STATUS: st.builds(wire.NodeStatus, node_id=ids, state=st.sampled_from(["online", "offline"])),
    wire.HEARTBEAT: st.builds(
        wire.Heartbeat,
        node_id=ids,
        state=st.sampled_from(["idle", "profiling", "training"]),
        job_id=st.none() | ids,
        step=st.none() | st.integers(0, 10**6),
        loss=st.none() | secs,
    ),
    wire.PROFILE: st.builds(
        wire.ProfileMessage,
        node_id=ids,
        profile=profiles,
        job_id=st.none() | ids,
        dims=st.none() | dims,
        rendezvous_port=st.none() | st.integers(1, 65535),
    ),
    wire.ASSIGNMENT: st.builds(wire.Assignment, job_id=ids, node_id=ids, phase=st.just("profile"), job=jobs)
    | splits.flatmap(
        lambda split: st.builds(
            wire.Assignment,
            job_id=ids,
            node_id=ids,
            phase=st.just("train"),
            job=jobs,
            rank=st.integers(0, split.world_size - 1),
            world_size=st.just(split.world_size),
            master_addr=st.just("10.0.0.1"),
            master_port=st.integers(1, 65535),
            split=st.just(split),
            profiles=st.none() | st.lists(profiles, min_size=split.world_size, max_size=split.world_size),
        )
    )
    | st.builds(wire.Assignment, job_id=ids, node_id=ids, phase=st.just("train"), job=jobs, rank=st.none()),
    wire.RESULT: st.builds(wire.NodeResult, job_id=ids, node_id=ids, ok=st.just(False), error=st.text(max_size=50))
    | st.builds(
        wire.NodeResult,
        job_id=ids,
        node_id=ids,
        ok=st.just(True),
        result=st.builds(
            RankResult,
            rank=st.integers(0, 8),
            losses=st.lists(secs, max_size=5),
            step_seconds=st.lists(secs, max_size=5),
            comm_seconds=st.lists(secs, max_size=5),
            param_bytes=st.integers(0, 2**40),
            peak_rss_bytes=st.integers(0, 2**40),
        ),
    ),
    wire.JOB_STATUS: st.builds(
        wire.JobStatus,
        job_id=ids,
        state=st.sampled_from(["planning", "running", "completed", "failed", "stopped"]),
        step=st.none() | st.integers(0, 10**6),
        loss=st.none() | secs,
        nodes=st.lists(ids, max_size=4),
        reason=st.none() | st.text(max_size=40),
    ),
    wire.TRAIN: st.builds(wire.TrainCommand, job_id=ids, job=jobs, nodes=st.none() | st.lists(ids, max_size=5)),
    wire.STOP: st.builds(wire.StopCommand, job_id=ids),
    wire.CONTROLLER_STATUS: st.builds(
        wire.ControllerStatus,
        state=st.sampled_from(["online", "offline"]),
        instance=ids,
        started=st.floats(0, 2e9),
        host=st.none() | st.text(max_size=40),
        pid=st.none() | st.integers(1, 2**22),
    ),
}


def test_every_topic_has_a_message_strategy():
    assert set(MESSAGES) == set(wire.TOPICS)


@pytest.mark.parametrize("topic", wire.TOPICS, ids=lambda t: t.model.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_messages_round_trip(topic, data):
    message = data.draw(MESSAGES[topic])
    assert topic.decode(topic.encode(message)) == message


@pytest.mark.parametrize("topic", wire.TOPICS, ids=lambda t: t.model.__name__)
@settings(max_examples=60, deadline=None)
@given(payload=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_garbage_is_a_wire_error_and_nothing_else(topic, payload):
    try:
        topic.decode(payload)
    except wire.WireError:
        pass


@pytest.mark.parametrize("topic", wire.TOPICS, ids=lambda t: t.model.__name__)
@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_wrong_version_unknown_fields_and_bad_ids_are_refused(topic, data):
    raw = json.loads(topic.encode(data.draw(MESSAGES[topic])))
    for broken in ({**raw, "schema_version": 2}, {**raw, "surprise": 1}):
        with pytest.raises(wire.WireError):
            topic.decode(json.dumps(broken).encode())
    id_field = next((k for k in ("node_id", "job_id") if k in raw), None)
    if id_field:
        with pytest.raises(wire.WireError):
            topic.decode(json.dumps({**raw, id_field: "a/b#"}).encode())


def test_oversized_payloads_are_dropped_unread():
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.HEARTBEAT.decode(b" " * (wire.MAX_PAYLOAD_BYTES + 1))


def test_topic_names_follow_the_contract():
    assert wire.NODE_STATUS.name("gw-1") == "xronos/nodes/gw-1/status"
    assert wire.ASSIGNMENT.subscription() == "xronos/nodes/+/assignment"
    assert wire.TRAIN.name() == "xronos/cmd/train"
    assert (wire.NODE_STATUS.retain, wire.HEARTBEAT.qos, wire.ASSIGNMENT.retain, wire.TRAIN.qos) == (True, 0, True, 1)


def test_a_training_assignment_must_be_complete_and_consistent():
    """Rejected at decode, before a node's worker indexes a list with it (`RankAssignment`)."""
    job = JobOptions(model="m", data="d", output="o")
    split = ShardSplit(kv_groups=[1, 1], mlp_columns=[64, 64], vocab_rows=[10, 10])
    good = dict(
        job_id="j",
        node_id="n",
        phase="train",
        job=job,
        rank=1,
        world_size=2,
        master_addr="10.0.0.1",
        master_port=29500,
        split=split,
    )
    wire.ASSIGNMENT.decode(wire.Assignment(**good).model_dump_json().encode())
    pipeline = {**good, "split": None, "stages": [(0, 3), (3, 4)]}
    wire.ASSIGNMENT.decode(wire.Assignment(**pipeline).model_dump_json().encode())
    three = {"kv_groups": [1, 1, 0], "mlp_columns": [64, 32, 32], "vocab_rows": [10, 5, 5]}
    for broken in (
        {"rank": 2},
        {"master_port": None},
        {"split": None},
        {"stages": [(0, 1), (1, 2)]},
        {"world_size": 3},  # the split is for 2: rank 2 would index past it
        {"split": three},
        {"profiles": []},
        {"phase": "profile"},
        {"split": None, "stages": [(0, 3)]},
        {"split": None, "stages": [(0, 3), (2, 4)]},
        {"split": None, "stages": [(1, 3), (3, 4)]},
    ):
        with pytest.raises(wire.WireError):
            wire.ASSIGNMENT.decode(
                json.dumps({**json.loads(wire.Assignment.model_construct(**good).model_dump_json()), **broken}).encode()
            )


def test_ids_are_read_back_from_concrete_topics():
    assert wire.HEARTBEAT.ident("xronos/nodes/gw-1/heartbeat") == "gw-1"
    assert wire.JOB_STATUS.ident("xronos/jobs/j1/status") == "j1"
    assert wire.TRAIN.ident("xronos/cmd/train") == ""
    assert wire.HEARTBEAT.ident("xronos/nodes/a/b/heartbeat") is None
    assert wire.HEARTBEAT.ident("xronos/nodes/gw-1/profile") is None


# -- the published contract: JSON Schemas and the documented examples --------------------------
DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_committed_json_schemas_match_the_wire_models():
    texts = {name: json.dumps(schema, indent=2) + "\n" for name, schema in wire.json_schemas().items()}
    committed = {p.name: p.read_text() for p in (DOCS / "schema").glob("*.json")}
    assert committed == texts, "docs/schema drifted from xronos/contract/wire.py: run `xronos schema`"
    assert {s["x-xronos-topic"] for s in wire.json_schemas().values()} == {t.subscription() for t in wire.TOPICS}


def test_every_topic_has_a_documented_example_that_the_models_accept():
    text = (DOCS / "control-plane.md").read_text()
    covered = set()
    for section in re.split(r"^### ", text, flags=re.M)[1:]:
        topic_name = re.match(r"`(xronos/[^`]+)`", section).group(1)
        payload = re.search(r"```json\n(.*?)```", section, flags=re.S).group(1)
        family = next(t for t in wire.TOPICS if t.ident(topic_name) is not None)
        message = family.decode(payload.encode())
        ident = family.ident(topic_name)
        own = getattr(message, "node_id", None) if "nodes/" in family.pattern else getattr(message, "job_id", None)
        assert not ident or own == ident, f"{topic_name}: the payload names {own}"
        covered.add(family)
    assert covered == set(wire.TOPICS), f"no example for {set(wire.TOPICS) - covered}"


def test_schema_command_writes_the_schemas_and_checks_them(tmp_path, capsys):
    from xronos.cli import main

    assert main(["schema", "--check", "--out", str(DOCS / "schema")]) == 0
    assert main(["schema", "--check", "--out", str(tmp_path)]) != 0
    assert "differs from the wire models" in capsys.readouterr().err
    assert main(["schema", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(wire.json_schemas())
    assert main(["schema", "--check", "--out", str(tmp_path)]) == 0
