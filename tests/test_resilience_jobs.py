"""No job hangs (issue 30, item 6) and the collective timeout (item 1), with real processes.

Mosquitto (passwords + deploy/ ACLs), `xronos controller` and two `xronos node`s: a job whose
results are far over one MQTT message completes with its whole report; a node whose worker is
frozen (SIGSTOP) fails its job by the watchdog, named, and is freed; a planning failure fails its
job with the reason. `xronos run` with a frozen worker: its peers give up after the job's
collective timeout, not gloo's 30 minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from live_cluster import (
    cmdline,
    descendants,
    node_process,
    spec_of,
    train_by_command,
    wait_for,
    worker_below,
    xronos_process,
)

from controller.jobs import STALL_STEPS, stall_limit
from edge_node.model_io import load_config
from edge_node.worker_process import free_port, stop_processes
from xronos.contract import wire
from xronos.contract.job import JobOptions
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import RankResult, RunReport, build_report, thin_series
from xronos.contract.splits import ModelDims
from xronos.mosquitto import Mosquitto

USERS = {"controller": "ctl-pw", "operator": "op-pw", "n0": "n0-pw", "n1": "n1-pw"}
LONG_STEPS = int(os.environ.get("XRONOS_LONG_JOB_STEPS", "2200"))
"""Steps of the long job: its nodes' results are ~115 bytes a step, over 256 KiB from ~2,300 steps
(benchmarks/long_job.py runs the 5,000-step one)."""
STALL_FLOOR = 4.0
WATCHDOG_TIMEOUT = 5.0


# -- the contract, without processes -------------------------------------------------------
def _result(steps: int, rank: int = 0) -> RankResult:
    return RankResult(
        rank=rank,
        losses=[10.0 / (k + 1) + 1e-9 * k for k in range(steps)],
        step_seconds=[0.0123456789 + 1e-7 * k for k in range(steps)],
        comm_seconds=[0.00123456789 + 1e-8 * k for k in range(steps)],
        segment_seconds=[(0.001 + 1e-9 * k, 0.002, 0.003) for k in range(steps)],
        param_bytes=1000,
        peak_rss_bytes=2000,
        measure_from=2,
    )


def test_a_long_result_goes_in_parts_that_fit_and_join_to_the_whole():
    whole = _result(5000)
    assert len(wire.RESULT.encode(wire.NodeResult(job_id="j", node_id="n", ok=True, result=whole))) > (
        wire.MAX_PAYLOAD_BYTES
    )
    parts = wire.result_parts("j", "n", whole)
    assert len(parts) > 1 and {p.parts for p in parts} == {len(parts)}
    wired = [wire.RESULT.decode(wire.RESULT.encode(p)) for p in parts]  # each one a valid message
    assert all(len(wire.RESULT.encode(p)) <= wire.RESULT_PART_BYTES for p in parts)
    assert wire.join_result_parts(list(reversed(wired))) == whole
    with pytest.raises(wire.WireError):
        wire.join_result_parts(wired[1:])
    short = _result(10)
    (alone,) = wire.result_parts("j", "n", short)
    assert alone.parts == 1 and alone.result == short
    with pytest.raises(ValueError):
        wire.NodeResult(job_id="j", node_id="n", ok=True, result=short, part=2, parts=2)


def test_thinned_series_keep_the_last_step_and_the_aggregates():
    report = build_report("tp", None, [None], [_result(102)], stages=[(0, 2)], dims=_dims())
    thin = thin_series(report, 4)
    assert thin.series_every == 4 and thin.losses[-1] == report.losses[-1] and len(thin.losses) == 27
    assert thin.losses[:3] == report.losses[0:9:4]
    assert thin.mean_step_seconds == report.mean_step_seconds and thin.idle_ratio == report.idle_ratio


def test_the_stall_limit_follows_the_predicted_step_and_the_collective_timeout():
    job = JobOptions(model="m", data="d", output="o", collective_timeout=30)
    assert stall_limit(job, None, 120) == 120 + 60
    assert stall_limit(job, 0.5, 120) == 120 + 60  # 20 steps of 0.5 s: the floor rules
    assert stall_limit(job, 10.0, 120) == STALL_STEPS * 10 + 60
    with pytest.raises(ValueError):
        JobOptions(model="m", data="d", output="o", collective_timeout=1)


def _dims() -> ModelDims:
    return ModelDims(
        hidden_size=48,
        num_layers=2,
        num_heads=6,
        num_kv_heads=3,
        head_dim=8,
        intermediate_size=160,
        vocab_size=320,
        tie_word_embeddings=True,
    )


# -- `xronos run`: the collective timeout -----------------------------------------------------
def test_xronos_run_survivors_give_up_on_a_frozen_worker_after_the_collective_timeout(tmp_path, model_dir, data_file):
    timeout = 6.0
    log = tmp_path / "run.log"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "xronos.cli",
            "run",
            "--model",
            str(model_dir("gqa_tied")),
            "--data",
            str(data_file),
            "--output",
            str(tmp_path / "out"),
            "--mode",
            "tp",
            "--nodes",
            "2",
            "--steps",
            "1000000",
            "--batch-size",
            "4",
            "--seq-len",
            "16",
            "--collective-timeout",
            str(timeout),
            "--metrics-port",
            str(free_port()),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    frozen = None
    try:

        def rank1_training():
            worker = worker_below(run.pid, "spec-1.json")
            spec = spec_of(worker, "spec-1.json") if worker is not None else None
            if worker is None or spec is None:
                return None
            run_dir = spec.parent
            progress = run_dir / "progress-1.jsonl"
            return worker if progress.is_file() and progress.read_text().count("\n") >= 3 else None

        frozen = wait_for(rank1_training, 120, "rank 1 to train a few steps", poll=0.2)
        os.kill(frozen, signal.SIGSTOP)
        stopped_at = time.monotonic()
        rc = run.wait(timeout=timeout + 60)
        took = time.monotonic() - stopped_at
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text(errors="replace")
    assert rc != 0, text[-3000:]
    # rank 0 waited in a collective for the frozen rank 1: failed after the timeout, not 30 minutes
    assert timeout - 1 <= took <= timeout + 30, (took, text[-3000:])
    error = next(line for line in text.splitlines() if line.startswith("xronos: error:"))
    # gloo's words (the ring), or the hub's sockets', which name the frozen rank
    assert "worker rank 0 exited" in error, error
    assert "Timed out waiting" in error or "Socket Timeout: rank 1 sent nothing for 6 s" in error, error


# -- over MQTT -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir, data_file):
    root = tmp_path_factory.mktemp("resilience")
    with Mosquitto(users=USERS) as broker:
        procs = [
            xronos_process(
                "controller",
                "--state-dir",
                str(root / "state"),
                "--stall-floor",
                str(STALL_FLOOR),
                user="controller",
                password=USERS["controller"],
                url=broker.url,
                log=root / "controller.log",
            )
        ]
        for node in ("n0", "n1"):
            procs.append(node_process(node, root, broker.url, USERS[node]))
        try:
            profiled: set[str] = set()
            idle_after: set[str] = set()

            def heard(_c, _u, m):
                node = m.topic.split("/")[2]
                if m.topic.endswith("/profile"):
                    profiled.add(node)
                elif node in profiled and json.loads(m.payload).get("state") == "idle":
                    idle_after.add(node)

            watcher = _client(broker.port, "operator")
            watcher.on_message = heard
            watcher.subscribe([(wire.PROFILE.subscription(), 1), (wire.HEARTBEAT.subscription(), 0)])
            wait_for(lambda: idle_after == {"n0", "n1"}, 180, "both nodes idle after their start-up profiles", 0.5)
            watcher.loop_stop()
            nodes = dict(zip(("n0", "n1"), procs[1:]))
            yield dict(root=root, broker=broker, model=model_dir("gqa_tied"), data=data_file, nodes=nodes)
        finally:
            stop_processes(procs, grace=15)


def _client(port: int, user: str) -> paho.Client:
    client = paho.Client(
        paho.CallbackAPIVersion.VERSION2, client_id=f"xronos-test-{user}-{time.monotonic_ns()}", protocol=paho.MQTTv311
    )
    client.username_pw_set(user, USERS[user])
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def _train(cluster, job_id: str, *extra: str, steps: int) -> subprocess.CompletedProcess:
    return train_by_command(
        cluster["broker"].url,
        USERS["operator"],
        cluster["model"],
        cluster["data"],
        cluster["root"] / f"out-{job_id}",
        job_id,
        *extra,
        steps=steps,
        seq_len=8,
        batch_size=2,
        log=cluster["root"] / f"train-{job_id}.log",
    )


def test_a_job_whose_results_exceed_one_message_completes_with_its_whole_report(cluster):
    root = cluster["root"]
    report_file = root / "long-report.json"
    result = _train(cluster, "long", "--mode", "tp", "--nodes", "n0,n1", "--report", str(report_file), steps=LONG_STEPS)
    assert result.returncode == 0, result.stdout + result.stderr
    report = RunReport.model_validate_json(report_file.read_text())
    # the nodes kept their whole results; each was over one message, so it went in parts
    results = [
        RankResult.model_validate_json((root / n / "jobs" / "long" / "result.json").read_text()) for n in ("n0", "n1")
    ]
    for r in results:
        assert len(r.step_seconds) == LONG_STEPS
        assert len(wire.RESULT.encode(wire.NodeResult(job_id="long", node_id="n0", ok=True, result=r))) > (
            wire.MAX_PAYLOAD_BYTES
        )
    # the report's aggregates are those of every step of both ranks
    again = build_report("tp", report.split, [None, None], results)
    assert report.measured_steps == again.measured_steps == LONG_STEPS - 2
    assert report.mean_step_seconds == pytest.approx(again.mean_step_seconds, rel=1e-12)
    assert report.idle_ratio == pytest.approx(again.idle_ratio, rel=1e-12)
    for mine, theirs in zip(report.nodes, again.nodes):
        assert mine.compute_seconds == pytest.approx(theirs.compute_seconds, rel=1e-12)
        assert mine.idle_seconds == pytest.approx(theirs.idle_seconds, rel=1e-12, abs=1e-12)
        assert mine.segment_wait_seconds == pytest.approx(theirs.segment_wait_seconds, rel=1e-12, abs=1e-12)
    assert report.losses[-1] == results[0].losses[-1]
    assert thin_series(again, report.series_every).losses == report.losses
    status = wire.JobStatus.model_validate_json((root / "state" / "jobs" / "long.json").read_text())
    assert status.state == "completed" and status.step == LONG_STEPS


def test_a_frozen_worker_fails_its_job_by_the_watchdog_and_the_node_is_freed(cluster):
    root = cluster["root"]
    done: dict = {}
    runner = threading.Thread(
        target=lambda: done.update(
            result=_train(
                cluster,
                "frozen",
                "--mode",
                "single",
                "--nodes",
                "n0",
                "--collective-timeout",
                str(WATCHDOG_TIMEOUT),
                steps=1_000_000,
            )
        )
    )
    runner.start()
    spec = str(root / "n0" / "jobs" / "frozen" / "spec.json")
    progress = root / "n0" / "jobs" / "frozen" / "progress.jsonl"

    def worker_training():
        if not progress.is_file() or progress.read_text().count("\n") < 3:
            return None
        return next((int(p) for p in os.listdir("/proc") if p.isdigit() and spec in cmdline(int(p))), None)

    pid = wait_for(worker_training, 120, "n0's worker to train")
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        runner.join(timeout=120)
        took = time.monotonic() - stopped_at
        result = done["result"]
        assert result.returncode != 0
        assert "frozen failed" in result.stderr and "no progress" in result.stderr and "node n0" in result.stderr
        # the limit: the floor (20 predicted steps of a tiny model are less) + 2 collective timeouts
        assert STALL_FLOOR + 2 * WATCHDOG_TIMEOUT - 1 <= took <= STALL_FLOOR + 2 * WATCHDOG_TIMEOUT + 30, took
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), 30, "the frozen worker to be stopped")
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    # n0 is free: a new job on it completes
    again = _train(cluster, "after-frozen", "--mode", "single", "--nodes", "n0", steps=3)
    assert again.returncode == 0, again.stdout + again.stderr


def test_a_planning_failure_fails_the_job_with_its_reason(cluster, request):
    """Profiles that cannot be planned from (a cost of 1e999, infinity once decoded) fail the job at once.

    The nodes' worker servers are paused until the test ends: a node's own profile, from a worker
    forked in milliseconds with its profile cached, would otherwise reach the controller first."""
    servers = [p for node in cluster["nodes"].values() for p in descendants(node.pid) if "forkserver" in cmdline(p)]
    assert len(servers) == 2, "each node runs a worker server"
    for server in servers:
        os.kill(server, signal.SIGSTOP)
    request.addfinalizer(lambda: [os.kill(server, signal.SIGCONT) for server in servers])
    dims = ModelDims.from_config(load_config(cluster["model"]))
    statuses: dict[str, wire.JobStatus] = {}
    watcher = _client(cluster["broker"].port, "operator")
    watcher.on_message = lambda _c, _u, m: m.payload and statuses.update({m.topic: wire.JOB_STATUS.decode(m.payload)})
    watcher.subscribe(wire.JOB_STATUS.name("unplannable"), qos=1)
    done: dict = {}
    runner = threading.Thread(
        target=lambda: done.update(result=_train(cluster, "unplannable", "--mode", "xronos", steps=5))
    )
    runner.start()
    wait_for(lambda: wire.JOB_STATUS.name("unplannable") in statuses, 60, "the job to be planning")
    for node in ("n0", "n1"):  # each node's own credentials: what a node with a broken clock or profiler sends
        client = _client(cluster["broker"].port, node)
        profile = DeviceProfile.model_validate_json(
            json.dumps(
                {
                    "device": node,
                    "shape": {
                        "hidden_size": 48,
                        "head_dim": 8,
                        "heads_per_group": 2,
                        "micro_batch": 2,
                        "seq_len": 8,
                        "mlp_block": 64,
                        "vocab_block": 256,
                        "threads": 1,
                    },
                    "kv_group_seconds": 0.001,
                    "mlp_block_seconds": 0.001,
                    "vocab_block_seconds": 0.001,
                    "layer_fixed_seconds": 0.001,
                    "step_fixed_seconds": 0.001,
                    "allreduce_latency_seconds": 0.001,
                    "allreduce_seconds_per_mib": 0.001,
                    "memory_bytes": 1 << 30,
                }
            )
        )
        payload = wire.PROFILE.encode(
            wire.ProfileMessage(node_id=node, job_id="unplannable", profile=profile, dims=dims, rendezvous_port=40000)
        ).replace(b'"kv_group_seconds":0.001', b'"kv_group_seconds":1e999')
        client.publish(wire.PROFILE.name(node), payload, qos=1, retain=True).wait_for_publish(5)
        client.loop_stop()
    runner.join(timeout=120)
    result = done["result"]
    watcher.loop_stop()
    assert result.returncode != 0
    assert "unplannable failed: cannot plan" in result.stderr, result.stderr
    final = statuses[wire.JOB_STATUS.name("unplannable")]
    assert final.state == "failed" and final.reason and final.reason.startswith("cannot plan")
