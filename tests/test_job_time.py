"""Mode xronos chooses its layout by the job's predicted time (issue 36, item 2).

Cases built from profiles: the fastest device alone wins when the others are too slow to help or the
job too short to pay back the start-up, and loses when they help; with equal devices the choice is
never predicted slower than even TP; the choice is never predicted slower than the fastest device
alone. Then one `xronos run` where it chose one device: the plain model trains, as mode single does.
"""

from __future__ import annotations

import random

import pytest
from test_partitioner import DIMS, profile, speed_profiles

from edge_node.launcher import run_local
from edge_node.toy_model import ONE_B_CONFIG, make_data, make_model
from xronos.contract.choice import LayoutCandidate
from xronos.contract.job import JobOptions
from xronos.contract.profiles import COMPUTE_FIELDS
from xronos.planner.job_plan import plan_job
from xronos.planner.job_time import ONE_DEVICE_MARGIN, RENDEZVOUS_SECONDS, choose

COMM = {"allreduce_latency_seconds": 0.02}
"""A step's collectives cost a few percent of a speed-1 device's step: spreading pays when the others are fast."""


def devices(speeds: list[float]):
    """Devices at these speeds whose whole step takes about 0.2 s at speed 1 (a small model's)."""
    return [
        p.model_copy(update={k: getattr(p, k) / 30 for k in COMPUTE_FIELDS} | {"allreduce_latency_seconds": 0.0007})
        for p in speed_profiles(speeds)
    ]


def job(steps: int = 100, **update) -> JobOptions:
    return JobOptions(
        **{"model": "m", "data": "d", "output": "o", "steps": steps, "batch_size": 2, "seq_len": 8} | update
    )


def candidate(plan, layout: str):
    return [c for c in plan.choice.candidates if c.layout == layout]


def test_the_fastest_device_alone_when_the_others_are_too_slow_to_help():
    profiles = speed_profiles([1.0, 0.05, 0.04], **COMM)
    plan = plan_job(job(), DIMS, profiles)
    assert plan.choice.chosen.layout == "single" and plan.choice.chosen.devices == ["d0"]
    assert plan.members == [0] and plan.plain and plan.rank_assignment(0, "127.0.0.1", 1).plain
    assert plan.reasons[0] is None and all(plan.reasons[1:])
    alone = plan.predicted_step_seconds
    assert all(c.job_seconds >= plan.choice.chosen.job_seconds for c in plan.choice.candidates)
    assert alone == pytest.approx(candidate(plan, "single")[0].step_seconds)
    print(plan.choice.describe())


def test_spread_when_the_others_help_and_alone_when_the_job_is_too_short_to_pay_back_the_start_up():
    profiles = devices([1.0, 0.9, 0.8])
    long = plan_job(job(steps=200), DIMS, profiles)
    assert long.choice.chosen.layout == "tp" and len(long.members) >= 2, long.choice.describe()
    [alone] = candidate(long, "single")
    assert long.choice.chosen.job_seconds < alone.job_seconds / (1 + ONE_DEVICE_MARGIN)
    assert not long.plain and long.profiles is not None  # it re-plans as before
    # one step: the rendezvous alone is longer than what the spread step saves
    gain = alone.step_seconds - long.choice.chosen.step_seconds
    assert gain < RENDEZVOUS_SECONDS
    short = plan_job(job(steps=1), DIMS, profiles)
    assert short.choice.chosen.layout == "single" and short.members == [0], short.choice.describe()
    # the same job resumed near its end has as few steps left
    resumed = plan_job(job(steps=200, resume=True, resume_step=199), DIMS, profiles)
    assert resumed.choice.chosen.layout == "single" and resumed.choice.chosen.steps == 1


def test_equal_devices_are_never_planned_slower_than_even_tp():
    for n in (2, 3, 4):
        plan = plan_job(job(), DIMS, speed_profiles([0.7] * n, **COMM))
        [even] = [c for c in candidate(plan, "tp") if c.note == "even"]
        assert plan.choice.chosen.job_seconds <= even.job_seconds + 1e-9, plan.choice.describe()


@pytest.mark.parametrize("seed", range(40))
def test_never_predicted_slower_than_the_fastest_device_alone(seed):
    rng = random.Random(seed)
    profiles = [profile(i, rng, slow=rng.choice([1, 2, 5, 20])) for i in range(rng.randint(1, 4))]
    plan = plan_job(job(steps=rng.choice([1, 5, 50, 500])), DIMS, profiles)
    [alone] = candidate(plan, "single")
    assert plan.choice.chosen.job_seconds <= alone.job_seconds + 1e-9
    assert plan.choice.chosen.devices == [profiles[d].device for d in plan.members]


def test_the_layouts_a_job_allows_are_its_candidates():
    profiles = speed_profiles([1.0, 0.05], **COMM)
    tp_only = plan_job(job(layouts=("tp",)), DIMS, profiles)
    assert {c.layout for c in tp_only.choice.candidates} == {"tp"} and not tp_only.plain
    both = plan_job(job(layouts=("pp", "single")), DIMS, devices([1.0, 0.9]))
    assert {c.layout for c in both.choice.candidates} == {"pp", "single"}, both.choice.describe()
    # a pipeline or TP plan on one device is not priced beside the plain model on it: the same job
    alone = plan_job(job(layouts=("pp", "single")), DIMS, profiles)
    assert [c.layout for c in alone.choice.candidates] == ["single"], alone.choice.describe()
    lora = plan_job(job(lora={"r": 2}), DIMS, profiles)
    assert "pp" not in {c.layout for c in lora.choice.candidates}  # a LoRA job does not pipeline
    with pytest.raises(ValueError, match="twice"):
        job(layouts=("tp", "tp"))


def test_a_pipeline_that_wins_is_planned_as_mode_pp_plans_it():
    profiles = speed_profiles([1.0, 1.0])
    plan = plan_job(job(layouts=("pp",)), DIMS, profiles)
    assert plan.stages is not None and plan.split is None and plan.choice.chosen.layout == "pp"
    assert plan.stages == plan_job(job(mode="pp"), DIMS, profiles).stages


def test_within_the_margin_one_device_is_chosen_and_the_report_says_why():
    def made(layout, devices, step):
        return LayoutCandidate(layout=layout, devices=devices, step_seconds=step, startup_seconds=0.0, steps=10)

    spread, alone = made("tp", ["a", "b"], 0.98), made("single", ["a"], 1.0)
    choice = choose([spread, alone])
    assert choice.chosen is alone and "margin" in (choice.reason or "")
    assert "longer than tp on 2 devices" in choice.describe()
    clear = choose([made("tp", ["a", "b"], 0.5), alone])
    assert clear.chosen.layout == "tp" and clear.reason is None and "50% shorter than single on a" in clear.describe()
    # an uneven split barely shorter than the even one on the same devices: the even one
    uneven = made("tp", ["a", "b"], 0.5).model_copy(update={"note": "uneven"})
    even = made("tp", ["a", "b"], 0.51).model_copy(update={"note": "even"})
    near = choose([uneven, even, alone])
    assert near.chosen is even and "margin an uneven split" in (near.reason or "")
    far = choose([uneven, even.model_copy(update={"step_seconds": 0.6}), alone])
    assert far.chosen is uneven and far.reason is None


def test_a_run_that_chose_one_device_trains_the_plain_model_as_mode_single_does(tmp_path):
    """Two devices, the second a quarter of the first: a 6-step job of a small model is shorter on the first alone.

    Without a head start: the first device may train all 6 steps before the second has profiled, and then no
    layout is chosen (`trained_ahead`, test_head_start.py); a clean-clone CI run met that race."""
    model = make_model(tmp_path / "model", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=96)
    data = make_data(tmp_path / "rows.jsonl", rows=24, seq_len=20, vocab=96)
    base = JobOptions(model=str(model), data=str(data), output=str(tmp_path / "x"), steps=6, batch_size=4, seq_len=16)
    chosen = run_local(base, 2, [1.0, 0.25], show_progress=False, head_start=False)
    assert chosen.layout_choice is not None and chosen.layout_choice.chosen.layout == "single"
    assert chosen.world_size == 1 and chosen.nodes[0].device == 0 and chosen.collective is None
    assert [e.device for e in chosen.excluded] == [1]
    single = run_local(
        base.model_copy(update={"mode": "single", "output": str(tmp_path / "s")}), 1, [1.0], show_progress=False
    )
    assert chosen.losses == single.losses  # the same plain model, the same rows: bit for bit
    # the whole job's time, start-up included, beside the steps' (what the choice was about)
    assert chosen.job_seconds > sum(chosen.step_seconds) and single.job_seconds > sum(single.step_seconds)


def test_no_layout_is_chosen_that_the_devices_memory_cannot_hold():
    """TinyLlama's shape (1.1B parameters) on four devices of 4 GiB: full fine-tuning fits no layout, the
    pipeline's included (its planner prices time alone; each stage would hold ~4.4 GiB); LoRA fits."""
    from test_lora_jobs import _profile
    from transformers import LlamaConfig

    from xronos.contract.errors import XronosError
    from xronos.contract.splits import ModelDims

    config = LlamaConfig(**ONE_B_CONFIG)
    dims = ModelDims.from_config(config)
    devices = [_profile(f"d{i}", 4 * 2**30) for i in range(4)]
    big = {"model": "m", "data": "d", "output": "o", "steps": 50, "batch_size": 1, "seq_len": 128}
    with pytest.raises(XronosError, match="has the memory"):
        plan_job(JobOptions(**big), dims, devices)
    with pytest.raises(XronosError, match="memory holds"):
        plan_job(JobOptions(**big, mode="pp"), dims, devices)
    adapted = plan_job(JobOptions(**big, lora={"r": 8}), dims, devices)
    assert adapted.choice.chosen.layout == "tp" and len(adapted.members) >= 2
    # four rows a step pipeline over four stages (one row a step is one stage: 1F1B needs a micro-batch per
    # stage): ~4.4 GiB each, which devices of 8 GiB hold
    roomy = [_profile(f"d{i}", 8 * 2**30) for i in range(4)]
    stages = plan_job(JobOptions(**big | {"batch_size": 4}, mode="pp"), dims, roomy).stages
    assert stages is not None and len(stages) == 4
