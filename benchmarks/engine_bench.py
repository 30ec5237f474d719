"""Benchmark: single vs even TP vs Xronos (profiled, planned) on emulated heterogeneous devices.

Prints, for one model of ~56M parameters (SmolLM2's layer shapes, 8 layers),
the mean step time of each mode, its ratio to even TP and to the compute-only
ideal (single-core step time / sum of speeds), and where each device's time
goes (compute, communication, idle). Not a test: numbers, to be quoted.

    python benchmarks/engine_bench.py --speeds 1,0.5,0.25 --steps 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from edge_node.launcher import run_local
from edge_node.toy_model import SMOL_SHAPES, make_data, make_model
from xronos.contract.job import JobOptions
from xronos.summary import node_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="1,0.5,0.25")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--modes", default="single,tp,xronos")
    parser.add_argument(
        "--kv-heads",
        type=int,
        default=SMOL_SHAPES["kv_heads"],
        help="KV heads (3 as SmolLM2; 9 = multi-head attention: finer attention shards)",
    )
    parser.add_argument("--json", help="write all reports here")
    args = parser.parse_args()
    speeds = [float(s) for s in args.speeds.split(",")]

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="xronos-bench-") as tmp:
        root = Path(tmp)
        shapes = {**SMOL_SHAPES, "kv_heads": args.kv_heads}
        model = make_model(root / "model", layers=args.layers, **shapes)
        data = make_data(root / "data.jsonl", rows=64, seq_len=args.seq_len, vocab=SMOL_SHAPES["vocab"])
        reports = {}
        for mode in args.modes.split(","):
            job = JobOptions(
                model=str(model),
                data=str(data),
                output=str(root / f"out-{mode}"),
                mode=mode,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                lr=1e-4,
            )
            nodes, node_speeds = (1, [1.0]) if mode == "single" else (len(speeds), speeds)
            reports[mode] = run_local(job, nodes, node_speeds, show_progress=False)
            print(f"{mode}: {reports[mode].mean_step_seconds:.3f} s/step", flush=True)
        n_params = reports[next(iter(reports))].nodes[0].param_bytes // 4 if "single" in reports else 0

    print(
        f"\nmodel: {args.layers} layers, {shapes}, {n_params / 1e6:.1f}M parameters; "
        f"batch {args.batch_size} x {args.seq_len} tokens; speeds {speeds} (sum {sum(speeds):g})"
    )
    ideal = reports["single"].mean_step_seconds / sum(speeds) if "single" in reports else None
    base = reports.get("tp")
    print(
        f"{'mode':<8} {'step s':>7} {'vs tp':>6} {'vs ideal':>8} {'idle':>6}  per device: compute / comm / idle s per step"
    )
    for mode, r in reports.items():
        vs_tp = f"{r.mean_step_seconds / base.mean_step_seconds:.2f}" if base else "-"
        vs_ideal = f"{r.mean_step_seconds / ideal:.2f}" if ideal else "-"
        per = "  ".join(node_seconds(n, r.measured_steps) for n in r.nodes)
        print(f"{mode:<8} {r.mean_step_seconds:>7.3f} {vs_tp:>6} {vs_ideal:>8} {r.idle_ratio:>6.1%}  {per}")
    if ideal:
        print(f"compute-only ideal: {ideal:.3f} s/step (single-core step / sum of speeds)")
    if args.json:
        Path(args.json).write_text(json.dumps({m: r.model_dump() for m, r in reports.items()}, indent=2))


if __name__ == "__main__":
    main()
