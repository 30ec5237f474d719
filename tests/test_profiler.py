"""The profiler's predictions hold under real CPU quotas, and profiles are cached per shape."""

from __future__ import annotations

import os
import statistics
import time

import pytest

from edge_node.cpu_quota import cgroup_quota_available
from edge_node.launcher import run_local
from edge_node.model_io import load_config
from edge_node.profiler import cached_profile, fit_fixed_and_per_unit, profile_device
from edge_node.toy_model import make_data, make_model
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.profiles import COMPUTE_FIELDS, DeviceProfile
from xronos.contract.report import WARMUP_STEPS
from xronos.contract.splits import ModelDims
from xronos.planner.cost_model import device_compute


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """Big enough that compute, not Python overhead, dominates a step."""
    root = tmp_path_factory.mktemp("mid")
    model = make_model(root / "model", hidden=256, layers=2, heads=8, kv_heads=4, intermediate=1024, vocab=8192)
    data = make_data(root / "rows.jsonl", rows=32, seq_len=64, vocab=8192)
    return model, data


@pytest.mark.skipif(not cgroup_quota_available(), reason="needs a writable cgroup v1 cpu controller (root)")
def test_predicted_device_step_within_20_percent_under_its_quota(mid_model, tmp_path, monkeypatch):
    """A device profiled under its CPU quota predicts its own step time (training alone, so
    nothing but its quota sets its pace), within the issue's 20%: the whole model on one device,
    from a profile taken at one unit and a share of each component. Measured is the median of
    the timed steps: on these shared, virtualised 2-core machines single steps under a quota move
    by ±15%, and so do profiles (17 runs here: ratios 0.84 to 1.33, most within 0.85-1.17). A
    systematic error fails all of three attempts, each with a fresh profile; noise rarely
    does (a per-unit cost without the fixed one measured 1.18-1.36 in CI, twice in a row at
    0.3). The worker joins its quota itself after its imports: half the speed must take about
    twice as long (not the same time, nor four times). Its two runs are half a minute apart on a
    machine whose pace drifts by 10-30% in minutes: a clean-clone CI run measured 0.226 s at 0.6
    and 0.634 s at 0.3 (2.8x; each within 20% of its own profile, which followed the drift),
    where three runs just after measured 2.05-2.06x."""
    model, data = mid_model
    measured = {}
    for speed in (0.6, 0.3):
        for attempt in range(3):
            monkeypatch.setenv("XRONOS_PROFILE_CACHE", str(tmp_path / f"cache-{speed}-{attempt}"))
            job = JobOptions(
                model=str(model),
                data=str(data),
                output=str(tmp_path / f"out-{speed}-{attempt}"),
                mode="xronos",
                steps=8,
                batch_size=4,
                seq_len=64,
                lr=1e-4,
            )
            report = run_local(job, 1, speeds=[speed], show_progress=False)
            assert report.predicted_step_seconds is not None
            measured[speed] = statistics.median(report.step_seconds[WARMUP_STEPS:])
            ratio = report.predicted_step_seconds / measured[speed]
            print(f"speed {speed}: predicted {report.predicted_step_seconds:.3f} s, measured {measured[speed]:.3f} s")
            if 0.8 <= ratio <= 1.2:
                break
        assert 0.8 <= ratio <= 1.2, f"speed {speed}"
    assert 1.5 < measured[0.3] / measured[0.6] < 3.0


def test_fixed_and_per_unit_costs_from_two_sizes():
    """A component timed at one unit and at a share: the line through both, unless noise makes it absurd."""
    assert fit_fixed_and_per_unit(3.0, 9.0, 4) == pytest.approx((1.0, 2.0))  # 1 s + 2 s per unit
    # the share no slower than one unit (noise): the flattest line allowed, half the share fixed
    assert fit_fixed_and_per_unit(3.0, 2.5, 4) == pytest.approx((1.25, 2.5 / 8))
    assert fit_fixed_and_per_unit(3.0, 2.49, 4) == pytest.approx(
        fit_fixed_and_per_unit(3.0, 2.51, 4), rel=0.01
    )  # no jump
    assert fit_fixed_and_per_unit(1.0, 9.0, 4) == (0.0, 9.0 / 4)  # superlinear: the line would need negative fixed
    assert fit_fixed_and_per_unit(0.04, 0.48644176886624985, 6)[0] == 0.0  # not -5.6e-17, which fails validation
    assert fit_fixed_and_per_unit(2.0, 2.0, 1) == (0.0, 2.0)  # one unit is all there is (a single KV group)


def test_profiles_are_cached_per_shape(mid_model, tmp_path, monkeypatch):
    monkeypatch.setenv("XRONOS_PROFILE_CACHE", str(tmp_path / "cache"))
    config = load_config(mid_model[0])
    first = profile_device(config, 2, 32, 1, device="d0")
    assert first.kv_group_seconds > 0 and first.mlp_block_seconds > 0 and first.vocab_block_seconds > 0
    # the weight-gradient products deferred as a rank that defers them runs them, and the backward's span
    assert 0 < first.mlp_weight_grad_fraction < 1 and 0 < first.attention_weight_grad_fraction < 1
    assert 0 < first.vocab_weight_grad_fraction < 1
    assert first.attention_weight_grad_fraction < first.attention_backward_fraction < 1
    # and each segment's forward pass: what its first all-reduce waits for
    forwards = (first.attention_forward_fraction, first.mlp_forward_fraction, first.vocab_forward_fraction)
    assert all(0.1 < f < 0.9 for f in forwards), forwards
    assert first.attention_forward_fraction + first.attention_backward_fraction <= 1
    again = profile_device(config, 2, 32, 1, device="d0")
    assert again.model_dump(exclude={"memory_bytes"}) == first.model_dump(exclude={"memory_bytes"})  # read back
    other = profile_device(config, 2, 16, 1, device="d0")  # another batch shape: measured anew
    assert other.shape.seq_len == 16 and other.profile_seconds > 0
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2
    # a profile older than its maximum age is measured anew (a device's pace drifts)
    cached = max((tmp_path / "cache").glob("*.json"), key=lambda q: q.stat().st_mtime)  # `other`'s
    os.utime(cached, (time.time() - 2 * 86400,) * 2)
    remeasured = profile_device(config, 2, 16, 1, device="d0")
    assert remeasured.model_dump(exclude={"memory_bytes"}) != other.model_dump(exclude={"memory_bytes"})
    assert time.time() - cached.stat().st_mtime < 600  # written back
    monkeypatch.setenv("XRONOS_PROFILE_MAX_AGE", "soon")
    with pytest.raises(XronosError, match="XRONOS_PROFILE_MAX_AGE"):
        profile_device(config, 2, 16, 1, device="d0")


def test_a_jobs_checks_teach_the_cache_its_pace(mid_model, tmp_path, monkeypatch):
    """A cached profile can be far off a job's pace (measured while another program loaded the machine; or
    under a CPU quota, a device that waits in collectives computes faster than it profiles). Each re-plan
    check recalibrates the profiles towards the compute the steps measured, and each device caches its
    own: the next job of these shapes plans with the pace the last one measured."""
    monkeypatch.setenv("XRONOS_PROFILE_CACHE", str(tmp_path / "cache"))
    model, data = mid_model
    config = load_config(model)
    dims = ModelDims.from_config(config)
    for device in ("device-0", "device-1"):  # the keys the job's workers look up: name, speed, shapes
        profile_device(config, 2, 32, 1, device=device, speed_hint=1.0)
    cached = {DeviceProfile.model_validate_json(p.read_text()).device: p for p in (tmp_path / "cache").glob("*.json")}
    for path in cached.values():  # both measured under a load of ten: every compute cost ten times the device's
        stale = DeviceProfile.model_validate_json(path.read_text())
        path.write_text(stale.model_copy(update={k: getattr(stale, k) * 10 for k in COMPUTE_FIELDS}).model_dump_json())
    job = JobOptions(
        model=str(model),
        data=str(data),
        steps=10,  # checks after steps 3, 4, ...: each leaves the steps a re-shard needs
        batch_size=2,
        seq_len=32,
        mode="xronos",
        replan_after=1,
        layouts=("tp",),
        output=str(tmp_path / "out"),
    )
    report = run_local(job, 2, speeds=[1.0, 1.0], show_progress=False)
    assert report.split.world_size == 2 and len(report.replans) >= 2, "the job should spread and check its plan"
    first = report.replans[0]
    for measured, predicted in zip(first.measured_compute_seconds, first.predicted_compute_seconds):
        assert measured < predicted / 4  # the stale profiles, against the job's first steps
    for node in report.nodes:  # the next job's plan prices the split this one ended with as its steps ran it
        learned = cached_profile(stale.shape, f"device-{node.device}", 1.0, None)
        assert learned is not None, "the check's profile is cached, young"
        predicted = device_compute(learned, dims, *report.split.shares()[node.rank])
        measured = node.compute_seconds / report.measured_steps
        assert 0.5 < predicted / measured < 2, (predicted, measured, report.replans)
    # a mode that does not profile is priced by the cached profiles, when every device has one
    even = run_local(job.model_copy(update={"mode": "tp", "steps": 4}), 2, speeds=[1.0, 1.0], show_progress=False)
    assert even.predicted_step_seconds is not None and 0.5 < even.predicted_step_seconds / even.mean_step_seconds < 2
    alone = run_local(job.model_copy(update={"mode": "single", "steps": 4}), 1, show_progress=False)
    assert alone.predicted_step_seconds is None  # no profile cached for a device of no emulated speed
