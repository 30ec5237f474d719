"""The job timeline (issue 36, item 1): every worker says when its start-up phases, first steps and
save ended, the report carries it, and it survives a result split into MQTT parts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from edge_node.launcher import run_local
from tests.conftest import SEQ_LEN
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.report import TIMELINE_EVENTS, RankResult, TimelineEvent

SPLIT = {"kv_groups": [2, 1], "mlp_columns": [96, 64], "vocab_rows": [200, 120]}
TP_PHASES = [e for e in TIMELINE_EVENTS if e not in ("profiled", "handoff", "plan_received", "reshard")]
"""What every rank of a TP job with a given split marks: no profile, no head start, no plan to wait for, no re-shard."""


def _job(model, data, out, mode: str) -> JobOptions:
    return JobOptions(
        model=str(model), data=str(data), output=str(out), mode=mode, steps=4, batch_size=4, seq_len=SEQ_LEN,
        lr=2e-3, seed=7, collective="hub",
    )  # fmt: skip


def _names(node) -> list[str]:
    return [e.name for e in node.timeline]


def _ordered(node) -> bool:
    times = [e.at_seconds for e in node.timeline]
    return times == sorted(times) and times[0] > 0


@pytest.fixture(scope="module")
def tp_run(model_dir, data_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "out"
    return run_local(
        _job(model_dir("gqa_tied"), data_file, out, "xronos"), 2, split_override=SPLIT, show_progress=False
    ), out


def test_every_rank_reports_its_phases_in_order(tp_run, model_dir, data_file, tmp_path):
    report, _ = tp_run
    for node in report.nodes:
        assert _names(node) == TP_PHASES, _names(node)
        assert _ordered(node) and node.started_at is not None
        assert node.segment_seconds is not None and all(s > 0 for s in node.segment_seconds)
        assert sum(node.segment_seconds) < node.compute_seconds
    single = run_local(_job(model_dir("gqa_tied"), data_file, tmp_path / "s", "single"), 1, show_progress=False)
    (node,) = single.nodes
    assert _names(node) == ["imports", "model_loaded", "first_step", "second_step", "last_step", "saved"]
    assert _ordered(node) and node.segment_seconds is None


def test_a_long_jobs_timeline_survives_a_result_split_into_mqtt_parts():
    steps = 5000
    timeline = [
        TimelineEvent(name="imports", at_seconds=1.5),
        TimelineEvent(name="reshard", at_seconds=9.0, seconds=0.2),
    ]
    result = RankResult(
        rank=0,
        losses=[1.0] * steps,
        step_seconds=[0.5] * steps,
        comm_seconds=[0.1] * steps,
        param_bytes=1,
        peak_rss_bytes=1,
        started_at=1.8e9,
        timeline=timeline,
    )
    parts = wire.result_parts("job", "n0", result, part_bytes=16_384)
    assert len(parts) > 1 and [len(p.result.timeline) for p in parts if p.result] == [2] + [0] * (len(parts) - 1)
    joined = wire.join_result_parts(list(reversed(parts)))
    assert joined.timeline == timeline and joined.started_at == 1.8e9 and len(joined.losses) == steps


def test_a_traced_job_writes_every_ranks_collectives_in_the_same_order(model_dir, data_file, tmp_path, monkeypatch):
    """`XRONOS_COLLECTIVE_TRACE`: each rank writes every all-reduce of its training (segment, start, end) and
    where each step began among them; the ranks list the same collectives, each rank's calls in time order, and
    `benchmarks/collective_trace.py` lays them side by side."""
    traces = tmp_path / "trace"
    monkeypatch.setenv("XRONOS_COLLECTIVE_TRACE", str(traces))
    run_local(_job(model_dir("gqa_tied"), data_file, tmp_path / "out", "xronos"), 2, split_override=SPLIT,
              show_progress=False)  # fmt: skip
    ranks = [json.loads((traces / f"rank-{r}.json").read_text()) for r in range(2)]
    layers = 2  # the gqa_tied test model's
    per_step = 4 * layers + 2 + 2  # the layers', the embedding's, the final norm's gradient's, the loss's two
    for rank, record in enumerate(ranks):
        assert record["rank"] == rank and len(record["steps"]) == 4
        assert [b - a for a, b in zip(record["steps"], record["steps"][1:])] == [per_step] * 3
        assert [c[0] for c in record["calls"]] == [c[0] for c in ranks[0]["calls"]]
        times = [t for _, start, end, _ in record["calls"] for t in (start, end)]
        assert times == sorted(times)
    closes = [c[0] for c in ranks[0]["calls"][ranks[0]["steps"][1] : ranks[0]["steps"][2]]]
    assert closes.count("kv_groups") == closes.count("mlp_columns") == 2 * layers
    out = subprocess.run(
        [sys.executable, "benchmarks/collective_trace.py", "--trace", str(traces), "--last", "2"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
    ).stdout  # fmt: skip
    assert "attention forward" in out and "MLP backward" in out and "rank 1" in out
