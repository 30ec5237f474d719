"""A LoRA job over MQTT: Mosquitto, `xronos controller`, two `xronos node`s and `xronos train --lora`,
all real processes. Its checkpoints are adapter-only and replicated (every rank writes the whole
adapter and its moments, `publish_shared`), and the output is an adapter peft loads."""

from __future__ import annotations

import json

import torch
from live_cluster import controller_sees, node_process, train_by_command, wait_for, xronos_process
from peft import PeftModel
from transformers import AutoModelForCausalLM

from edge_node.checkpoint import verify
from edge_node.lora_io import ADAPTER_STEM
from edge_node.worker_process import free_port, stop_processes
from xronos.contract.report import RunReport
from xronos.mosquitto import Mosquitto

USERS = {"controller": "ctl-pw", "operator": "op-pw", "n0": "n0-pw", "n1": "n1-pw"}


def test_a_lora_job_over_mqtt_checkpoints_the_adapter_on_every_rank_and_exports_it(tmp_path, model_dir, data_file):
    model = model_dir("gqa_tied")
    port = free_port()
    with Mosquitto(users=USERS) as broker:
        procs = [
            xronos_process(
                "controller",
                "--metrics-port",
                str(port),
                "--state-dir",
                str(tmp_path / "state"),
                user="controller",
                password=USERS["controller"],
                url=broker.url,
                log=tmp_path / "controller.log",
            )
        ]
        procs += [node_process(node, tmp_path, broker.url, USERS[node]) for node in ("n0", "n1")]
        try:
            wait_for(lambda: controller_sees(port, 2), 180, "the controller to see both nodes", 0.5)
            out, report = tmp_path / "out", tmp_path / "report.json"
            extra = ["--mode", "tp", "--nodes", "n0,n1", "--lora", "2", "--checkpoint-every", "2"]
            result = train_by_command(
                broker.url,
                USERS["operator"],
                model,
                data_file,
                out,
                "lora",
                *extra,
                "--report",
                str(report),
                steps=4,
                seq_len=8,
                batch_size=2,
                log=tmp_path / "train.log",
            )
        finally:
            stop_processes(procs, grace=15)
    assert result.returncode == 0, result.stdout + result.stderr
    assert RunReport.model_validate_json(report.read_text()).world_size == 2
    checkpoint = out / "checkpoints" / "step-00000002"
    verify(checkpoint)
    assert {p.name for p in checkpoint.glob("*.safetensors")} == {
        f"{ADAPTER_STEM}.safetensors",
        *(f"{k}.safetensors" for k in ("exp_avg", "exp_avg_sq")),
    }
    assert json.loads((checkpoint / "trainer_state.json").read_text())["lora"]["r"] == 2
    assert not (out / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, out)
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in adapted.named_parameters())
