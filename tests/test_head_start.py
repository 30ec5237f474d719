"""The head start (issue 36): in `xronos run`, the fastest device trains alone from the first step while the
others profile, and the plan takes over from its checkpoint.

The arithmetic from profiles first: the head start's device priced at its measured pace, and the plan for the
steps it leaves, with its device alone going on at no start-up cost. Then real runs: a job handed over to
two devices mid-way, and a job too short for any plan, each equal to single-process training.
"""

from __future__ import annotations

import pytest
from conftest import VOCAB
from test_job_time import devices, job
from test_partitioner import DIMS

from edge_node.head_start import PACE_STEPS
from edge_node.launcher import run_local
from edge_node.toy_model import make_model
from xronos.contract.job import JobOptions
from xronos.contract.report import HeadStart
from xronos.planner.head_start import head_start_profile, holds_whole_model, steady_compute, whole_model_seconds
from xronos.planner.job_plan import plan_job


def test_the_head_starts_profile_prices_the_whole_model_at_its_measured_pace():
    others = devices([0.5, 0.25])
    pace = whole_model_seconds(others[0], DIMS) / 2.5  # 2.5x the 0.5 device: the 0.25 one is not the shape taken
    own = head_start_profile(others, DIMS, pace, "d9", 1.0, 2**33)
    assert whole_model_seconds(own, DIMS) == pytest.approx(pace)
    assert (own.device, own.speed_hint, own.memory_bytes, own.profile_seconds) == ("d9", 1.0, 2**33, 0.0)
    # its shares are priced as the fastest other device's, scaled: a tenth of the MLP costs the same part
    assert own.mlp_fixed_seconds / own.mlp_block_seconds == pytest.approx(
        others[0].mlp_fixed_seconds / others[0].mlp_block_seconds
    )
    # and it moves an all-reduce's bytes at the pace it computes
    assert own.allreduce_seconds_per_mib == pytest.approx(others[0].allreduce_seconds_per_mib / 2.5)
    # the pace is the median of the steps after the warm-up, none before there is one
    assert steady_compute([9.0, 3.0]) is None and steady_compute([9.0, 3.0, 1.0, 2.0, 1.5]) == 1.5


def test_the_plan_counts_the_steps_the_head_start_trained_and_its_device_goes_on_for_free():
    profiles = [p.model_copy(update={"allreduce_seconds_per_mib": 0.01}) for p in devices([1.0, 0.9, 0.8])]
    head = HeadStart(device=0, steps=30, compute_seconds=[0.2] * 30)
    plan = plan_job(job(steps=200), DIMS, profiles, head)
    assert {c.steps for c in plan.choice.candidates} == {200 - 31}  # and the one under way
    alone = [c for c in plan.choice.candidates if c.layout == "single"]
    assert [c.devices for c in alone] == [["d0"]] and alone[0].startup_seconds == 0
    without = plan_job(job(steps=200), DIMS, profiles)
    spread = next(c for c in plan.choice.candidates if c.layout == "tp")
    before = next(c for c in without.choice.candidates if c.describe() == spread.describe())
    assert spread.startup_seconds > before.startup_seconds  # the handoff: its state written and read back
    # no other device alone: device 1 (0.9) is priced by its profile, device 0 by its steps
    slower = HeadStart(device=1, steps=30, compute_seconds=[0.2] * 30)
    assert [
        c.devices for c in plan_job(job(steps=200), DIMS, profiles, slower).choice.candidates if c.layout == "single"
    ] == [["d1"]]
    # a device holds the whole model alone, or is not given the head start
    assert holds_whole_model(2**33, DIMS, 2, 8) and not holds_whole_model(2**20, DIMS, 2, 8)


def _job(model, data, out, mode: str, **update) -> JobOptions:
    options = dict(model=str(model), data=str(data), output=str(out), mode=mode, batch_size=4, seq_len=16, lr=2e-3)
    return JobOptions(**options | dict(seed=7) | update)


def _equal_losses(got: list[float], want: list[float], rtol: float = 1e-5) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= rtol * abs(b), (a, b)


def test_a_job_handed_over_mid_way_equals_single_process_training(data_file, tmp_path, monkeypatch):
    """Two equal devices: device 0 trains alone while device 1 profiles, then both go on with TP from the
    handoff checkpoint. A model wide enough that TP pays on two devices (even TP predicted ~0.5x one device's
    step; the suite's `gqa_wide` only 0.95x, within the margin that keeps one device)."""
    monkeypatch.setenv("XRONOS_PROFILE_CACHE", str(tmp_path / "cache"))
    model = make_model(tmp_path / "model", hidden=512, layers=2, heads=8, kv_heads=4, intermediate=2048, vocab=VOCAB)
    steps = 150
    single = run_local(
        _job(model, data_file, tmp_path / "single", "single", steps=steps, lr=1e-4), 1, show_progress=False
    )
    out = tmp_path / "xronos"
    report = run_local(
        _job(model, data_file, out, "xronos", steps=steps, layouts=("tp", "single"), lr=1e-4),
        2,
        [1.0, 1.0],
        show_progress=False,
    )
    head = report.head_start
    assert head is not None and head.device == 0 and not head.finished
    assert 3 <= head.steps < steps and len(head.compute_seconds) == min(head.steps, PACE_STEPS)
    assert head.checkpoint.endswith(f"handoff-{head.steps:08d}") and head.handoff_seconds > 0
    assert not (out / "checkpoints").exists()  # the run's own, not the user's output: gone with the run
    assert report.world_size == 2 and report.layout_choice.chosen.layout == "tp"
    # every step's loss, the head start's and the plan's, as single-process training's: float32 round-off,
    # which 150 steps grow to 1e-5 at most (9.6e-6 measured; a step that lost AdamW's moments at the handoff
    # would move the loss by ~lr x the gradient's L1 norm, orders of magnitude more)
    _equal_losses(report.losses[:3], single.losses[:3])
    _equal_losses(report.losses, single.losses, rtol=1e-4)
    assert len(report.step_seconds) == steps - head.steps  # the plan's steps are the ones timed
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    events = [e.name for e in next(n for n in report.nodes if n.device == 0).timeline]
    assert events.index("first_step") < events.index("plan_received") < events.index("handoff")
    assert "profiled" not in events  # it never profiled: its profile came from its steps
    own = report.profiles[0]
    assert own.device == "device-0" and own.profile_seconds == 0


def test_a_job_shorter_than_the_others_profiling_is_the_head_starts_alone(model_dir, data_file, tmp_path, monkeypatch):
    monkeypatch.setenv("XRONOS_PROFILE_CACHE", str(tmp_path / "cache"))
    model = model_dir("gqa_tied")
    single = run_local(_job(model, data_file, tmp_path / "single", "single", steps=3), 1, show_progress=False)
    out = tmp_path / "xronos"
    report = run_local(_job(model, data_file, out, "xronos", steps=3), 3, [0.5, 1.0, 0.25], show_progress=False)
    assert report.head_start == report.head_start.model_copy(update={"device": 1, "steps": 3, "finished": True})
    assert report.head_start.checkpoint is None
    assert report.world_size == 1 and [n.device for n in report.nodes] == [1]
    assert [(e.device, e.reason) for e in report.excluded] == [
        (0, "the head start trained the whole job first"),
        (2, "the head start trained the whole job first"),
    ]
    _equal_losses(report.losses, single.losses)
    assert (out / "config.json").is_file()
    # without the head start, every device profiles and the plan comes first
    plain = run_local(
        _job(model, data_file, tmp_path / "without", "xronos", steps=3),
        3,
        [0.5, 1.0, 0.25],
        show_progress=False,
        head_start=False,
    )
    assert plain.head_start is None and plain.layout_choice is not None
    # and every device's profile is cached now: the plan comes at once, with no head start to wait for
    again = run_local(
        _job(model, data_file, tmp_path / "again", "xronos", steps=3), 3, [0.5, 1.0, 0.25], show_progress=False
    )
    assert again.head_start is None and all(p.profile_seconds > 0 for p in again.profiles)


def test_a_head_start_without_a_steady_step_when_the_others_have_profiled_is_given_up(data_file, tmp_path, monkeypatch):
    """Steps too long for the head start to pay (a large vocabulary, 32-row batches: seconds a step, while the
    other device profiles in about two): the plan does not wait for the head start's steady step; its device
    starts afresh with the plan, from the model, and the job equals single-process training."""
    monkeypatch.setenv("XRONOS_PROFILE_CACHE", str(tmp_path / "cache"))
    model = make_model(tmp_path / "model", hidden=256, layers=1, heads=4, kv_heads=2, intermediate=512, vocab=96000)
    options = dict(steps=3, batch_size=32)
    single = run_local(_job(model, data_file, tmp_path / "single", "single", **options), 1, show_progress=False)
    report = run_local(
        _job(model, data_file, tmp_path / "xronos", "xronos", **options), 2, [1.0, 0.5], show_progress=False
    )
    head = report.head_start
    assert head is not None and head.given_up and head.steps < 3 and head.checkpoint is None
    _equal_losses(report.losses, single.losses)
    assert len(report.profiles) == 2 and report.profiles[0].profile_seconds == 0  # priced by the speeds
