"""`xronos demo`: the main job on one machine with nothing but the package installed.

Makes a small Llama model and a learnable data set, then fine-tunes it on 3
emulated devices of different speeds twice: with the even tensor-parallel
split (`tp`) and with the speed-aware split (`xronos`), and prints both side
by side. (The control-plane issue turns this into the full MQTT flow.)
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from edge_node.launcher import run_local
from edge_node.toy_model import make_data, make_model
from xronos.job import JobOptions
from xronos.summary import print_report, print_side_by_side

DEMO_MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=768, vocab=2048)
SEQ_LEN, BATCH = 64, 8


def run_demo(workdir: str | None = None, steps: int = 8, speeds: list[float] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    speeds = speeds or [1.0, 0.5, 0.25]
    with tempfile.TemporaryDirectory(prefix="xronos-demo-") as tmp:
        root = Path(workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        model = make_model(root / "model", **DEMO_MODEL)
        data = make_data(root / "data.jsonl", rows=256, seq_len=SEQ_LEN, vocab=DEMO_MODEL["vocab"])
        print(f"demo: model {model} ({DEMO_MODEL}), data {data}, {len(speeds)} devices at speeds {speeds}")
        reports = []
        for mode in ("tp", "xronos"):
            job = JobOptions(
                model=str(model), data=str(data), output=str(root / f"out-{mode}"), mode=mode,
                steps=steps, batch_size=BATCH, seq_len=SEQ_LEN, lr=1e-3, shuffle=False,
            )
            report = run_local(job, len(speeds), speeds)
            print_report(report)
            reports.append(report)
        print_side_by_side(reports)
    return 0
