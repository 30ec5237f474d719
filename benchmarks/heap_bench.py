"""Benchmark: a worker's step time with glibc's default heap and with the heap kept (`HEAP_OPTIONS`).

Runs `single` mode on one full core with SmolLM2's layer shapes, alternating
the two settings (default, kept, default, kept, ...) so that the machine's
drift hits both alike, and prints each run's mean step (the report's
measured steps: all but the warm-up) and peak RSS, then the ratio of the means. Not a test: numbers,
to be quoted.

    python benchmarks/heap_bench.py --rounds 2 --steps 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from edge_node.launcher import run_local
from edge_node.toy_model import SMOL_SHAPES, make_data, make_model
from xronos.contract.job import JobOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    steady: dict[str, list[float]] = {"default": [], "kept": []}
    with tempfile.TemporaryDirectory(prefix="xronos-heap-") as tmp:
        root = Path(tmp)
        model = make_model(root / "model", layers=args.layers, **SMOL_SHAPES)
        data = make_data(root / "data.jsonl", rows=64, seq_len=128, vocab=SMOL_SHAPES["vocab"])
        for round_ in range(args.rounds):
            for setting in steady:
                os.environ["XRONOS_KEEP_HEAP"] = "1" if setting == "kept" else "0"
                job = JobOptions(
                    model=str(model),
                    data=str(data),
                    output=str(root / "out"),
                    mode="single",
                    steps=args.steps,
                    batch_size=4,
                    seq_len=128,
                    lr=1e-4,
                )
                report = run_local(job, 1, [1.0], show_progress=False)
                mean = report.mean_step_seconds
                steady[setting].append(mean)
                rss = report.nodes[0].peak_rss_bytes / 2**30
                print(
                    f"round {round_ + 1} heap {setting:<7}: steps {[round(s, 2) for s in report.step_seconds]}"
                    f" -> steady mean {mean:.3f} s, peak RSS {rss:.2f} GiB",
                    flush=True,
                )
    default, kept = statistics.mean(steady["default"]), statistics.mean(steady["kept"])
    print(
        f"\nsteady step: default heap {default:.3f} s, heap kept {kept:.3f} s, ratio kept/default {kept / default:.2f}"
    )


if __name__ == "__main__":
    main()
