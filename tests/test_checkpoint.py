"""Checkpoints: HF-loadable, atomic, resumable with a different split and world size, and replicated on
every rank (jobs over MQTT) so that any one rank's copy resumes the job."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from edge_node import checkpoint
from edge_node.launcher import _watch, run_local
from edge_node.preflight import job_inputs
from edge_node.trainer import WorkerSpec
from edge_node.worker_process import free_port, start_worker
from tests.conftest import SEQ_LEN
from xronos.contract.assignment import RankAssignment
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.report import RankResult
from xronos.contract.splits import ShardSplit


def _job(model, data, out, mode, **kw):
    kw.setdefault("checkpoint_every", 3)
    return JobOptions(
        model=str(model),
        data=str(data),
        output=str(out),
        mode=mode,
        steps=6,
        batch_size=4,
        seq_len=SEQ_LEN,
        lr=2e-3,
        seed=5,
        **kw,
    )


def test_resume_with_another_split_continues_the_same_training(model_dir, data_file, tmp_path):
    model = model_dir("gqa_tied")
    first = tmp_path / "first"
    uneven = {"kv_groups": [2, 1, 0], "mlp_columns": [100, 40, 20], "vocab_rows": [160, 100, 60]}
    full = run_local(_job(model, data_file, first, "xronos"), 3, split_override=uneven, show_progress=False)
    ckpt, rejected = checkpoint.latest_checkpoint(first)
    assert ckpt is not None and ckpt.name == "step-00000003" and rejected == []
    assert not any(p.name.startswith((".tmp-", ".old-", ".final")) for p in first.rglob("*"))
    assert AutoModelForCausalLM.from_pretrained(ckpt) is not None  # a checkpoint is a plain HF model

    # A crash at step 4 of another run: only the step-3 checkpoint survives. Resume on 2 even ranks.
    second = tmp_path / "second"
    shutil.copytree(ckpt, second / "checkpoints" / ckpt.name)
    # and a newer one torn by the crash (its model file cut short), and a crashed save's leftovers
    torn = shutil.copytree(ckpt, second / "checkpoints" / "step-00000005")
    with open(torn / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    (second / "checkpoints" / ".tmp-step-00000006-99").mkdir()
    resumed = run_local(_job(model, data_file, second, "tp", resume=True), 2, show_progress=False)

    assert len(resumed.losses) == 6 and len(resumed.step_seconds) == 3  # from step 3, torn step 5 passed over
    assert not (second / "checkpoints" / ".tmp-step-00000006-99").exists()
    for got, want in zip(resumed.losses, full.losses):
        assert abs(got - want) / want < 1e-5
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-4, msg=key)


def _sealed_checkpoint(output, step, model="m"):
    directory = checkpoint.checkpoint_dir(output, step)
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (directory / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": step, "model": model}))
    checkpoint.seal(directory, {})
    return directory


def test_a_checkpoint_that_does_not_match_its_manifest_is_passed_over_with_the_reason(tmp_path):
    root = tmp_path / checkpoint.CHECKPOINTS
    good = _sealed_checkpoint(tmp_path, 4)
    assert checkpoint.latest_checkpoint(tmp_path) == (good, [])
    (root / ".tmp-step-00000008-123").mkdir()  # a crash mid-write leaves only a temporary name
    (root / "step-00000009").mkdir()  # no manifest: never sealed
    truncated = _sealed_checkpoint(tmp_path, 10)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(100)
    flipped = _sealed_checkpoint(tmp_path, 11)
    data = bytearray((flipped / "model.safetensors").read_bytes())
    data[500] ^= 1
    (flipped / "model.safetensors").write_bytes(data)
    torn_state = _sealed_checkpoint(tmp_path, 12)
    (torn_state / checkpoint.TRAINER_STATE).write_text('{"step": 1')
    found, rejected = checkpoint.latest_checkpoint(tmp_path)
    assert found == good
    assert rejected == [
        f"step-00000012: {checkpoint.TRAINER_STATE} has 10 bytes, not {len(json.dumps({'step': 12, 'model': 'm'}))}",
        "step-00000011: model.safetensors does not match its checksum",
        "step-00000010: model.safetensors has 100 bytes, not 10240",
        f"step-00000009: no readable {checkpoint.MANIFEST} (FileNotFoundError)",
    ]
    assert checkpoint.clean_leftovers(tmp_path) == [root / ".tmp-step-00000008-123"]


def test_checkpoints_are_fsynced_and_only_a_handoff_is_not(tmp_path, monkeypatch):
    """`write_checkpoint` fsyncs every file and directory it writes; with `durable=False` (a head start's
    handoff, read back at once on the same host) none, and the checkpoint holds the same bytes, sealed."""
    params = {"w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.randn(4))}
    shapes = {name: p.shape for name, p in params.items()}
    written = {}
    for durable in (True, False):
        synced: list[int] = []
        monkeypatch.setattr(checkpoint.os, "fsync", lambda fd, synced=synced: synced.append(fd))
        final = tmp_path / f"durable-{durable}"
        checkpoint.write_checkpoint(
            final,
            params,
            shapes,
            lambda name, rank: None,
            0,
            1,
            "model",
            lambda tmp: None,
            trainer_state={"step": 1},
            durable=durable,
        )
        monkeypatch.undo()
        checkpoint.verify(final)  # the manifest matches either way
        written[durable] = (final / "model.safetensors").read_bytes(), len(synced)
    assert written[True][1] >= 3  # the file, the manifest, the directory (and its parent)
    assert written[False][1] == 0
    assert written[True][0] == written[False][0]


def test_resume_errors_are_one_line(tmp_path):
    job = JobOptions(model="m", data="d", output=str(tmp_path), steps=8, resume=True)
    with pytest.raises(XronosError, match="no usable checkpoint under"):
        checkpoint.resume_point(tmp_path, job)
    _sealed_checkpoint(tmp_path, 4)
    assert checkpoint.resume_point(tmp_path, job).name == "step-00000004"
    with pytest.raises(XronosError, match="--steps 4 is not beyond the checkpoint's step 4"):
        checkpoint.resume_point(tmp_path, job.model_copy(update={"steps": 4}))
    with pytest.raises(XronosError, match="was trained from --model m, not other"):
        checkpoint.resume_point(tmp_path, job.model_copy(update={"model": "other"}))


def test_publish_keeps_the_old_directory_until_the_new_one_is_in_place(tmp_path):
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "old").write_text("1")
    tmp = tmp_path / "new"
    tmp.mkdir()
    (tmp / "new").write_text("2")
    checkpoint.publish_dir(tmp, final)
    assert [p.name for p in final.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_streamed_safetensors_split_into_indexed_files(tmp_path):
    from safetensors.torch import load_file as load

    from edge_node.model_io import SafetensorsReader
    from edge_node.tp.plan import Slice

    tensors = {"a": torch.randn(3, 4), "b.weight": torch.randn(10), "c": torch.randn(2, 2, 2)}
    shapes = {k: v.shape for k, v in tensors.items()}
    checkpoint.write_safetensors(tmp_path, "model", shapes, iter(tensors.items()), max_bytes=48)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]
    assert torch.equal(load(tmp_path / files[1])["b.weight"], tensors["b.weight"])
    reader = SafetensorsReader(tmp_path)
    assert torch.equal(reader.read("a", Slice(1, 1, 3)), tensors["a"][:, 1:3])
    assert torch.equal(reader.read("c"), tensors["c"])


def _run_ranks(run_dir: Path, jobs: list[JobOptions], split: ShardSplit) -> list[RankResult]:
    """Rank r of a job with `jobs[r]` (its own output), as node agents start it: its own preflight,
    replicated checkpoints, real processes over gloo. Returns the ranks' results."""
    run_dir.mkdir()
    port = free_port()
    workers = []
    try:
        for rank, job in enumerate(jobs):
            _, rows, resume_from = job_inputs(job)
            save_file({"input_ids": rows}, run_dir / f"rows-{rank}.safetensors")
            spec = WorkerSpec(
                job=job,
                device=rank,
                assignment=RankAssignment(
                    rank=rank, world_size=len(jobs), master_addr="127.0.0.1", master_port=port, split=split
                ),
                rows_file=str(run_dir / f"rows-{rank}.safetensors"),
                resume_from=str(resume_from) if resume_from is not None else None,
                result_file=str(run_dir / f"result-{rank}.json"),
                replicate_checkpoints=True,
            )
            worker, _ = start_worker(spec, run_dir / f"spec-{rank}.json", run_dir / f"rank-{rank}.log", None, "-")
            workers.append(worker)
        _watch(workers, run_dir)
    finally:
        for worker in workers:
            worker.proc.kill()
    return [RankResult.model_validate_json((run_dir / f"result-{r}.json").read_text()) for r in range(len(jobs))]


def test_replicated_checkpoints_let_any_ranks_copy_resume_with_another_split(model_dir, data_file, tmp_path):
    model = model_dir("gqa_tied")
    uneven = ShardSplit(kv_groups=[2, 1, 0], mlp_columns=[100, 40, 20], vocab_rows=[160, 100, 60])
    outputs = [tmp_path / f"node-{r}" for r in range(3)]
    jobs = [_job(model, data_file, out, "xronos", checkpoint_every=2) for out in outputs]
    full = _run_ranks(tmp_path / "first", jobs, uneven)

    # every rank holds the whole of every checkpoint, byte for byte the same (steps 2 and 4 of 6)
    assert [checkpoint.sealed_steps(out) for out in outputs] == [[2, 4]] * 3
    for step in (2, 4):
        copies = [checkpoint.checkpoint_dir(out, step) for out in outputs]
        for copy in copies:
            checkpoint.verify(copy)
        manifests = {(copy / checkpoint.MANIFEST).read_text() for copy in copies}
        assert len(manifests) == 1
        assert {"model.safetensors", "exp_avg.safetensors", "config.json"} <= set(json.loads(manifests.pop())["files"])
    assert checkpoint.newest_sealed_step(outputs[1]) == 4
    assert (outputs[0] / "model.safetensors").is_file()  # the final model: rank 0's alone
    assert not (outputs[2] / "model.safetensors").exists()
    assert not any(p.name.startswith((".tmp-", ".old-", ".final")) for out in outputs for p in out.rglob("*"))

    # nodes 0 and 1 are lost with their disks; the survivor's copy alone resumes the job on 2 ranks of
    # another split, both writing one shared output (two agents on one host), from the older step 2
    for out in outputs[:2]:
        shutil.rmtree(out)
    survivor = outputs[2]
    job = _job(model, data_file, survivor, "tp", checkpoint_every=2, resume=True, resume_step=2)
    even = ShardSplit(kv_groups=[2, 1], mlp_columns=[80, 80], vocab_rows=[160, 160])
    resumed = _run_ranks(tmp_path / "second", [job, job], even)

    assert len(resumed[0].losses) == 6 and len(resumed[0].step_seconds) == 4  # from step 2
    for got, want in zip(resumed[0].losses, full[0].losses):
        assert abs(got - want) / want < 1e-5
    assert checkpoint.sealed_steps(survivor) == [2, 4]
    checkpoint.verify(checkpoint.checkpoint_dir(survivor, 4))
    assert not any(p.name.startswith((".tmp-", ".old-", ".final")) for p in survivor.rglob("*"))


def test_resume_step_picks_that_checkpoint_or_says_why_not_in_one_line(tmp_path):
    job = JobOptions(model="m", data="d", output=str(tmp_path), steps=8, resume=True)
    _sealed_checkpoint(tmp_path, 2)
    _sealed_checkpoint(tmp_path, 4)
    assert checkpoint.resume_point(tmp_path, job).name == "step-00000004"
    at = lambda step: job.model_copy(update={"resume_step": step})  # noqa: E731
    assert checkpoint.resume_point(tmp_path, at(2)).name == "step-00000002"
    with pytest.raises(
        XronosError, match=r"^--resume: resume_step 3 has no checkpoint here \(.*step-00000003 is missing\)$"
    ):
        checkpoint.resume_point(tmp_path, at(3))
    (checkpoint.checkpoint_dir(tmp_path, 2) / "model.safetensors").write_bytes(b"torn")
    with pytest.raises(XronosError, match=r"^--resume: resume_step 2's checkpoint cannot be used: .*has 4 bytes"):
        checkpoint.resume_point(tmp_path, at(2))
    with pytest.raises(ValidationError, match="resume_step 2 needs resume"):
        JobOptions(model="m", data="d", output="o", steps=8, resume_step=2)
    with pytest.raises(ValidationError, match="resume_step 8 is not before --steps 8"):
        JobOptions(model="m", data="d", output="o", steps=8, resume=True, resume_step=8)
    assert checkpoint.sealed_steps(tmp_path) == [2, 4]
    assert checkpoint.newest_sealed_step(tmp_path / "nowhere") is None


def _staged(output: Path, step: int, writer: int, content: bytes) -> Path:
    """A sealed temporary checkpoint directory, as one rank's save leaves it before publishing."""
    tmp = checkpoint._temp_dir(checkpoint.checkpoint_dir(output, step), writer)
    (tmp / "model.safetensors").write_bytes(content)
    (tmp / checkpoint.TRAINER_STATE).write_text(json.dumps({"step": step, "model": "m"}))
    checkpoint.seal(tmp, {})
    return tmp


def _publish_and_prune(start: threading.Barrier, tmp: Path, final: Path) -> None:
    start.wait()  # all at once
    checkpoint.publish_shared(tmp, final)
    checkpoint.prune_checkpoints(final.parent.parent, 2)


def test_concurrent_identical_publication_leaves_one_valid_checkpoint(tmp_path):
    writers, rounds = 4, 6
    for step in range(1, rounds + 1):
        final = checkpoint.checkpoint_dir(tmp_path, step)
        staged = [_staged(tmp_path, step, w, bytes(range(256)) * step) for w in range(writers)]
        start = threading.Barrier(writers)
        threads = [threading.Thread(target=_publish_and_prune, args=(start, tmp, final)) for tmp in staged]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        checkpoint.verify(final)
        assert (final / "model.safetensors").read_bytes() == bytes(range(256)) * step
    root = tmp_path / checkpoint.CHECKPOINTS
    assert sorted(p.name for p in root.iterdir()) == [checkpoint.LOCK, "step-00000005", "step-00000006"]
    # a checkpoint of that step with other bytes (a run before a resume) is replaced, not kept
    other = _staged(tmp_path, 6, 0, b"other")
    checkpoint.publish_shared(other, checkpoint.checkpoint_dir(tmp_path, 6))
    assert (checkpoint.checkpoint_dir(tmp_path, 6) / "model.safetensors").read_bytes() == b"other"
    assert checkpoint.latest_checkpoint(tmp_path)[0] == checkpoint.checkpoint_dir(tmp_path, 6)


def test_a_restart_of_the_job_in_flight_stops_its_worker_after_the_grace(tmp_path, monkeypatch):
    """The controller resumes a job on the survivors with a new `profile` assignment for the same job:
    the node stops the worker still running it (after END_GRACE, as for any message that ends a job,
    in case it is a forgery the controller undoes) before it profiles for the restart."""
    from edge_node.agent import NodeAgent, NodeOptions, _Job
    from xronos.contract import wire
    from xronos.contract.mqtt import BrokerSettings

    node = NodeAgent(NodeOptions(node_id="n1", workdir=tmp_path, startup_profile=False), BrokerSettings())
    events: list = []

    def end_job():
        events.append(("end", node.job.id if node.job else None))
        node.job = None

    def profile_for(a):
        events.append(("profile", a.ts))
        node.job = _Job(a.job_id, a.job, tmp_path / a.job_id)

    monkeypatch.setattr(node, "_end_job", end_job)
    monkeypatch.setattr(node, "_profile_for", profile_for)
    job = JobOptions(model="m", data="d", output=str(tmp_path / "out"))
    first = wire.Assignment(job_id="j1", node_id="n1", phase="profile", job=job, ts=1.0)
    node._receive(first)
    node._receive(first)  # a retained copy delivered again: nothing
    restart = first.model_copy(update={"ts": 2.0, "job": job.model_copy(update={"resume": True, "resume_step": 2})})
    node._receive(restart)
    assert events == [("profile", 1.0)] and node.pending is not None  # waits the grace
    node._receive(first)  # the controller puts its assignment back: the restart was a forgery
    assert node.pending is None and events == [("profile", 1.0)]
    node._receive(restart)
    node._handle(node.pending[0])  # the grace is over
    assert events == [("profile", 1.0), ("end", "j1"), ("profile", 2.0)]
    assert node.job is not None and node.job.job.resume_step == 2
    published: list = []
    monkeypatch.setattr(node.bus, "publish", lambda topic, ident, message: published.append(message))
    node._heartbeat()
    _sealed_checkpoint(tmp_path / "out", 2)
    (checkpoint.checkpoint_dir(tmp_path / "out", 4)).mkdir()  # not sealed: not reported
    node._heartbeat()
    assert [m.checkpoint for m in published] == [None, 2]
