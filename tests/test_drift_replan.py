"""A device slowed down mid-job re-plans the job (issue 30, item 2), really run.

Mosquitto, `xronos controller`, three `xronos node`s at speed 0.5 and `xronos train --wait` as separate
processes train a 3-node xronos job. Past the job's first checks, in its second half, the test cuts one
node's worker to a quarter of its CPU quota (its cgroup v1 cpu group, as another program taking the
device's CPU would): the ranks' drift checks see that node's compute drift from the plan and re-shard
in memory, giving it a smaller share. The report shows the re-plan ("drift-c drifted x3.1"), the node's
metrics its compute and its new shard, and the job trains as an uninterrupted run does.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
from live_cluster import node_process, train_by_command, uninterrupted, wait_for, xronos_process
from prometheus_client.parser import text_string_to_metric_families
from test_partitioner import DIMS, speed_profiles
from transformers import AutoModelForCausalLM

from edge_node.cpu_quota import CGROUP_V1_CPU, cgroup_quota_available
from edge_node.toy_model import make_data, make_model
from edge_node.trainer import (
    CALIBRATION_CHECKS,
    CALIBRATION_RESHARDS,
    MAX_RESHARDS,
    RESHARD_MIN_STEPS_LEFT,
    Trainer,
)
from edge_node.worker_process import free_port, stop_processes
from xronos.contract.job import JobOptions
from xronos.contract.lora import LoraOptions
from xronos.contract.report import ReplanCheck, RunReport, drifted
from xronos.mosquitto import Mosquitto
from xronos.planner.cost_model import parameter_count
from xronos.planner.job_time import reshard_seconds
from xronos.planner.replan import MIN_REPLAN_GAIN, payback_gain

NODES = ("drift-a", "drift-b", "drift-c")
"""Ids no other test's nodes have: an agent starting removes the empty cpu groups of its id's earlier
jobs, which a concurrent test's node of the same id would take for this one's (a worker joins its
group once its imports are done)."""
USERS = {"controller": "ctl-pw", "operator": "op-pw"} | {node: f"{node}-pw" for node in NODES}
SLOWED = "drift-c"
STEPS, BATCH, SEQ = 48, 8, 64
"""About 0.2 s a step at speed 0.5 on 2 shared cores (a model wide enough that three devices share it),
0.45 s while one of them runs at a quarter of its quota."""
THROTTLE_AT = 28
"""After the job's first checks (at most 8 checks and 3 re-shards: step 24 at the latest), in its second
half, where the job's re-planning used to stop."""
JOB = "drift"


def metrics(port: int, **labels: str) -> dict[str, float]:
    """The samples a process serves (those with `labels`, when given), by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if labels.items() <= sample.labels.items()
    }


def share(line: dict, dims: tuple[int, int, int]) -> float:
    """What a progress line says the node holds: its fractions of KV groups, MLP columns and vocabulary."""
    return sum(line[key] / whole for key, whole in zip(("kv_groups", "mlp_columns", "vocab_rows"), dims))


# -- when checks run and what they measure, without processes ------------------------------------
def _trainer(steps_done: int, measure_from: int = 0, checks: int = 0, reshards: int = 0) -> Trainer:
    """A trainer's re-plan state alone (no model, no process group): a 3-rank xronos job of 100 steps."""
    t = Trainer.__new__(Trainer)
    t.job = JobOptions(model="m", data="d", output="o", steps=100, replan_after=2)
    t.assignment = SimpleNamespace(profiles=[])
    t.world, t.start_step, t.step_seconds = 3, 0, [0.1] * steps_done
    t.measure_from, t.replan_checks, t.reshards = measure_from, checks, reshards
    return t


def test_checks_go_on_for_the_whole_job_and_later_ones_measure_a_recent_window():
    first = _trainer(10)
    assert first.replan_due(9) and first.calibrating() and first.measured_steps(True) == range(2, 10)
    assert not _trainer(11).replan_due(10)  # every replan_after timed steps
    # past the first checks: a window of the last DRIFT_WINDOW timed steps, not all of the split's
    later = _trainer(60, checks=CALIBRATION_CHECKS)
    assert later.replan_due(59) and not later.calibrating() and later.measured_steps(False) == range(56, 60)
    assert not _trainer(60, checks=2, reshards=CALIBRATION_RESHARDS).calibrating()
    # late in the job too, while a re-shard leaves its warm-up and a timed step; not after the re-shard cap
    assert RESHARD_MIN_STEPS_LEFT == 3 and _trainer(96, checks=CALIBRATION_CHECKS).replan_due(95)  # 4 steps left
    assert not _trainer(98, checks=CALIBRATION_CHECKS).replan_due(97)
    assert not _trainer(60, checks=CALIBRATION_CHECKS, reshards=MAX_RESHARDS).replan_due(59)
    # just after a re-shard, a drift check waits for a whole window of the new split's timed steps
    assert not _trainer(62, measure_from=60, checks=CALIBRATION_CHECKS).replan_due(61)
    resharded = _trainer(64, measure_from=60, checks=CALIBRATION_CHECKS)
    assert resharded.replan_due(63) and resharded.measured_steps(False) == range(60, 64)


def test_drift_is_beyond_the_threshold_either_way_and_a_reshard_must_pay_back():
    assert drifted(1.2) and drifted(1 / 1.2) and not drifted(1.05) and not drifted(0.95) and not drifted(0.0)
    check = ReplanCheck(after_step=9, measured_compute_seconds=[0.1, 0.3, 0.0], predicted_compute_seconds=[0.1] * 3)
    assert check.drift() == pytest.approx([1.0, 3.0, 1.0])
    assert payback_gain(None, 0.5, 10) == 0.0  # no cost given: counted free
    assert payback_gain(0.5, 1.0, 10) == pytest.approx(0.05)  # above MIN_REPLAN_GAIN: not capped
    assert payback_gain(0.5, 1.0, 0) == 1.0


def test_a_first_reshard_must_pay_back_the_estimate_the_job_was_priced_with():
    """Before any re-shard has been timed, a check prices one as the layout's job time did: counted free, a
    320M-parameter model's first re-shard took 9.0 s to save 2.5 s over the 8 steps its job had left."""
    t = _trainer(4)
    t.dims = DIMS.model_copy(update={"hidden_size": 2048, "intermediate_size": 5632, "vocab_size": 32000})
    t.assignment = SimpleNamespace(profiles=speed_profiles([1.0, 0.5, 0.25], allreduce_seconds_per_mib=0.01))
    t.replans, t.last_check = [], None
    estimate = reshard_seconds(t.profiles, t.dims, t.job)
    assert estimate / 96 > MIN_REPLAN_GAIN  # 96 steps left of 1 s: the re-shard must save more than 3%
    assert t.min_replan_gain(1.0) == pytest.approx(estimate / 96)
    timed = ReplanCheck(after_step=3, measured_compute_seconds=[1.0] * 3, predicted_compute_seconds=[1.0] * 3)
    t.replans = [timed.model_copy(update={"reshard_seconds": estimate / 10})]  # once one is timed, its own seconds
    assert t.min_replan_gain(1.0) == pytest.approx(max(MIN_REPLAN_GAIN, estimate / 10 / 96))
    # a LoRA job moves its factors with their moments and the frozen base with its split (half of it in bfloat16)
    lora = [
        reshard_seconds(t.profiles, t.dims, t.job.model_copy(update={"lora": LoraOptions(r=4, base_dtype=d)}))
        for d in ("float32", "bfloat16")
    ]
    base = parameter_count(t.dims) * 4 / 3 / 2**20 * 0.01  # float32 base: each rank's third, at 0.01 s per MiB
    assert lora[0] - lora[1] == pytest.approx(base / 2) and lora[1] > base / 2


def test_a_node_slowed_mid_job_gets_a_smaller_share_by_a_drift_replan(tmp_path):
    if not cgroup_quota_available():
        pytest.skip("throttles a node's worker through its cgroup v1 cpu group (root)")
    dims = (4, 1024, 320)  # the model's KV groups, MLP columns, vocabulary rows
    model = make_model(
        tmp_path / "model", hidden=256, layers=2, heads=8, kv_heads=4, intermediate=1024, vocab=320, tie=True, seed=1
    )
    data = make_data(tmp_path / "rows.jsonl", rows=64, seq_len=SEQ + 4, vocab=320, seed=3)
    root = tmp_path / "cluster"
    root.mkdir()
    with Mosquitto(users=USERS) as broker:
        ports = {name: free_port() for name in ("controller", *NODES)}
        procs = [
            xronos_process(
                "controller",
                "--metrics-port",
                str(ports["controller"]),
                "--state-dir",
                str(root / "state"),
                user="controller",
                password=USERS["controller"],
                url=broker.url,
                log=root / "controller.log",
            )
        ]
        for node in NODES:
            procs.append(node_process(node, root, broker.url, USERS[node], "--speed", "0.5", metrics_port=ports[node]))
        try:

            def online() -> bool:
                try:
                    return metrics(ports["controller"]).get("xronos_nodes_online") == 3
                except OSError:
                    return False

            wait_for(online, 120, "the controller to see 3 nodes", poll=0.5)
            done: dict = {}
            report_file = root / "report.json"
            runner = threading.Thread(
                target=lambda: done.update(
                    result=train_by_command(
                        broker.url,
                        USERS["operator"],
                        model,
                        data,
                        root / "out",
                        JOB,
                        "--mode",
                        "xronos",
                        "--layouts",
                        "tp",  # the three devices, not the fastest alone: the job re-plans its TP split
                        "--nodes",
                        ",".join(NODES),
                        "--report",
                        str(report_file),
                        steps=STEPS,
                        seq_len=SEQ,
                        batch_size=BATCH,
                        log=root / "train.log",
                    )
                )
            )
            runner.start()
            # the node removes its progress file when the job ends: keep what it said, step by step
            progress = root / SLOWED / "jobs" / JOB / "progress.jsonl"
            lines: list[dict] = []

            def read_progress() -> int:
                try:
                    text = progress.read_text()
                except OSError:
                    return len(lines)
                got = [json.loads(line) for line in text.splitlines() if line.endswith("}")]
                if len(got) > len(lines):
                    lines[:] = got
                return len(lines)

            wait_for(lambda: read_progress() >= THROTTLE_AT or not runner.is_alive(), 240, f"step {THROTTLE_AT}")
            if len(lines) < THROTTLE_AT:
                runner.join()
                pytest.fail(f"the job ended before step {THROTTLE_AT}: {done['result'].stderr[-3000:]}")
            group = CGROUP_V1_CPU / f"xronos-node-{SLOWED}-{JOB}"
            assert group.is_dir(), "the node's worker runs under its cpu group"
            # a quarter of its 0.5 core: 1 ms every 8 ms (the kernel's minimum quota is 1 ms)
            at_throttle = metrics(ports[SLOWED], node=SLOWED, job_id=JOB)
            (group / "cpu.cfs_period_us").write_text("8000")
            (group / "cpu.cfs_quota_us").write_text("1000")
            throttled_after = read_progress()
            before = share(lines[-1], dims)
            # the node's metrics by the steps they count: the agent reads progress a poll behind the
            # worker, so windows are cut by the metrics' own step count, not by the time they were read
            by_steps: dict[float, dict[str, float]] = {}
            while runner.is_alive():
                read_progress()
                try:
                    now = metrics(ports[SLOWED], node=SLOWED, job_id=JOB)
                except OSError:
                    now = {}
                by_steps.setdefault(now.get("xronos_step_seconds_count", 0.0), now)
                time.sleep(0.1)
            runner.join()
            at_end = metrics(ports[SLOWED], node=SLOWED, job_id=JOB)
        finally:
            stop_processes(procs, grace=15)

    result = done["result"]
    assert result.returncode == 0, result.stdout + result.stderr
    report = RunReport.model_validate_json(report_file.read_text())
    assert report.world_size == 3 and len(report.losses) == STEPS
    rank = next(n.rank for n in report.nodes if n.name == SLOWED)

    # a re-plan after the throttle found the node drifted and re-sharded it to a smaller share
    after_throttle = [c for c in report.replans if c.after_step > throttled_after and c.new_split is not None]
    assert after_throttle, [(c.after_step, c.drift()) for c in report.replans]
    first = after_throttle[0]
    assert drifted(first.drift()[rank]) and first.drift()[rank] > 1, first
    kv, mlp, vocab = first.new_split.shares()[rank]
    new_share = kv / dims[0] + mlp / dims[1] + vocab / dims[2]
    assert new_share < before, (before, first.new_split.describe())
    # ... and said so in the report `xronos train --wait` printed
    said = [line for line in result.stdout.splitlines() if line.startswith(f"re-plan after step {first.after_step}:")]
    assert said and f"{SLOWED} drifted x" in said[0] and "re-sharded to" in said[0], result.stdout

    # the node's metrics show both: its compute per step up while throttled, then its smaller shard
    def compute_per_step(since: dict, until: dict) -> float:
        steps = until["xronos_step_seconds_count"] - since.get("xronos_step_seconds_count", 0.0)
        return (until["xronos_compute_seconds_total"] - since.get("xronos_compute_seconds_total", 0.0)) / steps

    # throttled: from the first step that ran wholly under the quota to the step before the re-shard
    from_count = min(c for c in by_steps if c >= throttled_after + 1)
    to_count = max(c for c in by_steps if c <= first.after_step)
    assert to_count > from_count, (sorted(by_steps), throttled_after, first.after_step)
    slowed = compute_per_step(by_steps[from_count], by_steps[to_count])
    assert slowed > 1.5 * compute_per_step({}, at_throttle), (slowed, compute_per_step({}, at_throttle))
    assert at_end["xronos_shard_mlp_columns"] == lines[-1]["mlp_columns"] and share(lines[-1], dims) < before

    # the numbers (-s): step seconds before the throttle, while throttled, after the re-plan
    def median_step(lo: int, hi: int) -> float:
        return statistics.median(line["step_seconds"] for line in lines[lo:hi])

    replanned = first.after_step
    print(
        f"\nDRIFT throttled {SLOWED} (rank {rank}) after step {throttled_after}, re-planned after step {replanned}"
        f" (x{first.drift()[rank]:.2f}): share {before:.2f} -> {new_share:.2f}; compute per step"
        f" {compute_per_step({}, at_throttle):.3f} s before, {slowed:.3f} s throttled (metrics); median step"
        f" {median_step(throttled_after - 6, throttled_after):.3f} s before,"
        f" {median_step(throttled_after, replanned):.3f} s throttled,"
        f" {median_step(replanned + 2, STEPS):.3f} s after\n"
        + "\n".join(line for line in result.stdout.splitlines() if line.startswith("re-plan after"))
    )
    assert median_step(throttled_after, replanned) > median_step(throttled_after - 6, throttled_after)

    # it trained as an uninterrupted run on the same data does; the exported model loads
    assert AutoModelForCausalLM.from_pretrained(root / "out").config.num_hidden_layers == 2
    reference = uninterrupted(model, data, tmp_path / "single", steps=STEPS, batch_size=BATCH, seq_len=SEQ)
    assert report.losses[-1] == pytest.approx(reference.losses[-1], rel=0.01)
