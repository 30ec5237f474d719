"""Checkpoints: HF-loadable, atomic, and resumable with a different split and world size."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from edge_node import checkpoint
from edge_node.launcher import run_local
from tests.conftest import SEQ_LEN
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions


def _job(model, data, out, mode, **kw):
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
        checkpoint_every=3,
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
