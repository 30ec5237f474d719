"""Benchmark: what attention finer than whole KV groups costs on slow emulated devices.

With 3 KV groups on devices of speeds 1, 0.5 and 0.25, whole groups go 2/1/0
and the 0.25 device waits through every attention segment: the idle the plan
predicts. Finer shares would give it work, if a fraction of a group cost its
fraction. This measures whether it does, in two parts:

1. Each speed in turn (alone, under its CPU quota, on one core): one layer's
   Hugging Face attention, forward + backward + AdamW, for 2 groups, 1 group,
   row shares of a group (3 of 4 rows, 1 row: what `kv_rows` computes) and
   query-head shares (2 heads or 1 head with the group's whole K/V projection:
   what splitting a group by heads would compute). Printed in ms and as a
   multiple of the linear cost (fraction x the group's time). Then the
   attention segment per layer (its slowest device) and each device's wait,
   for three layouts: whole groups 2/1/0, rows 2/1[0:3]/1[3:4], heads 6/2/1.
2. With `--ab-rounds N`: whole groups against the row-shared layout as whole
   jobs (fixed splits, MLP and vocabulary by speed, the same for both),
   alternating N times so the machine's drift hits both: step, idle, and per
   device compute / communication / idle seconds per step.

Not a test: numbers, to be quoted. Quotas as in `xronos run` (cgroup v1 as root, else the
duty-cycle fallback); the row layouts are quarters of a 4-row micro-batch.

    python benchmarks/attention_share_bench.py --ab-rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch  # imported here, before a worker joins its quota: startup is not what is timed
from transformers import AutoConfig
from transformers.masking_utils import create_causal_mask

from edge_node.profiler import mean_seconds, model_variant, training_step
from xronos.contract.splits import ModelDims

HEADS_PER_GROUP = 3
"""The layouts below are for SmolLM2's attention: 3 KV groups of 3 query heads."""

VARIANTS = {
    # name: (KV groups, query heads per group, rows of the micro-batch, the share's fraction of one group)
    "2 groups": (2, HEADS_PER_GROUP, None, 2.0),
    "1 group": (1, HEADS_PER_GROUP, None, 1.0),
    "rows 3/4": (1, HEADS_PER_GROUP, 3, 0.75),
    "rows 1/4": (1, HEADS_PER_GROUP, 1, 0.25),
    "heads 2/3": (1, 2, None, 2 / 3),
    "heads 1/3": (1, 1, None, 1 / 3),
}

LAYOUTS = {
    # per device (fastest first): the variant it computes, or None (no attention: it waits)
    "whole 2/1/0": ("2 groups", "1 group", None),
    "rows 2/1[0:3]/1[3:4]": ("2 groups", "rows 3/4", "rows 1/4"),
    "heads 6/2/1": ("2 groups", "heads 2/3", "heads 1/3"),
}


def time_variants(model_dir: str, batch: int, seq_len: int) -> dict[str, float]:
    """Seconds of each variant on this process (already under its quota)."""
    torch.set_num_threads(1)
    config = AutoConfig.from_pretrained(model_dir)
    dims = ModelDims.from_config(config)
    seconds = {}
    for name, (groups, heads, rows, _) in VARIANTS.items():
        shaped = dims.model_copy(update={"num_heads": groups * heads, "num_kv_heads": groups})
        model = model_variant(config, shaped, 1, groups, dims.mlp_block, 8).model
        layer = model.layers[0]
        h = torch.randn(rows or batch, seq_len, dims.hidden_size, requires_grad=True)
        positions = torch.arange(seq_len).unsqueeze(0)
        mask = create_causal_mask(
            config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=positions
        )
        rope = model.rotary_emb(h, position_ids=positions)
        step = training_step(
            lambda layer=layer, h=h, rope=rope, mask=mask: layer.self_attn(
                hidden_states=h, position_embeddings=rope, attention_mask=mask
            )[0],
            list(layer.self_attn.parameters()),
        )
        seconds[name] = min(mean_seconds({name: step})[name] for _ in range(3))
    return seconds


def measure_speed(model_dir: str, speed: float, batch: int, seq_len: int) -> dict[str, float]:
    """`time_variants` in a child process under a CPU quota of `speed` cores, pinned to one core."""
    from edge_node.cpu_quota import make_quota, start_under

    quota = make_quota(f"xronos-attn-bench-{os.getpid()}-{round(speed * 1000)}", speed)
    try:
        child = subprocess.Popen(
            [
                "taskset",
                "-c",
                "1",
                sys.executable,
                __file__,
                "--worker",
                quota.procs_file or "",
                "--model",
                model_dir,
                "--batch-size",
                str(batch),
                "--seq-len",
                str(seq_len),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        start_under(quota, child.pid)
        out, _ = child.communicate()
    finally:
        quota.close()
    if child.returncode:
        raise SystemExit(f"error: timing at speed {speed:g} failed (exit {child.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def print_segments(speeds: list[float], timed: dict[float, dict[str, float]]) -> None:
    print(
        f"\n{'variant':<10}"
        + "".join(f"{f'speed {s:g}':>22}" for s in speeds)
        + "   (ms; x = ms / (fraction x 1 group's ms))"
    )
    for name, (*_, fraction) in VARIANTS.items():
        cells = "".join(
            f"{timed[s][name] * 1e3:>13.1f} ({timed[s][name] / (fraction * timed[s]['1 group']):.2f}x)" for s in speeds
        )
        print(f"{name:<10}{cells}")
    print("\nattention segment per layer (ms; its slowest device) and each device's wait in it:")
    for layout, per_device in LAYOUTS.items():
        ms = [timed[s][v] * 1e3 if v else 0.0 for s, v in zip(speeds, per_device)]
        waits = " ".join(f"[{s:g}] {max(ms) - m:.1f}" for s, m in zip(speeds, ms))
        print(f"  {layout:<22} segment {max(ms):6.1f}   waits {waits}   (sum {sum(max(ms) - m for m in ms):.1f})")


def run_ab(model_dir: str, data: str, speeds: list[float], rounds: int, steps: int, batch: int, seq_len: int) -> None:
    from edge_node.launcher import run_local
    from xronos.contract.job import JobOptions
    from xronos.summary import node_seconds

    layouts = {
        "whole 2/1/0": {"kv_groups": [2, 1, 0]},
        "rows 2/1[0:3]/1[3:4]": {"kv_groups": [2, 1, 1], "kv_rows": [None, (0, 3), (3, 4)]},
    }
    print(f"\nwhole jobs, fixed splits (MLP and vocabulary by speed), {steps} steps, {rounds} rounds in turn:")
    with tempfile.TemporaryDirectory(prefix="xronos-attn-ab-") as out:
        for _ in range(rounds):
            for name, override in layouts.items():
                job = JobOptions(
                    model=model_dir,
                    data=data,
                    output=out,
                    mode="xronos",
                    steps=steps,
                    batch_size=batch,
                    seq_len=seq_len,
                    lr=1e-4,
                )
                r = run_local(job, len(speeds), speeds=speeds, split_override=override, show_progress=False)
                per = " ".join(node_seconds(d, r.measured_steps) for d in r.nodes)
                print(
                    f"  {name:<22} step {r.mean_step_seconds:.3f} s  idle {r.idle_ratio:5.1%}   compute/comm/idle {per}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", help="a model directory with 3 KV groups of 3 heads (default: SmolLM2's shapes, 8 layers)"
    )
    parser.add_argument("--data", help="JSONL text for --ab-rounds (default: made up)")
    parser.add_argument("--speeds", default="1,0.5,0.25")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--ab-rounds", type=int, default=0)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        from edge_node.cpu_quota import join_quota

        if args.worker:
            join_quota(args.worker)
        print(json.dumps(time_variants(args.model, args.batch_size, args.seq_len)))
        return
    speeds = [float(s) for s in args.speeds.split(",")]
    if len(speeds) != 3 or speeds != sorted(speeds, reverse=True):
        sys.exit("error: --speeds must list 3 speeds, fastest first (the layouts are for 3 devices)")
    if args.batch_size != 4:
        sys.exit("error: --batch-size must be 4 (the row layouts are quarters of a 4-row micro-batch)")

    from transformers.utils import logging as hf_logging

    from edge_node.toy_model import SMOL_SHAPES, make_data, make_model

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="xronos-attn-bench-") as tmp:
        model = args.model or str(make_model(Path(tmp) / "model", layers=8, **SMOL_SHAPES))
        data = args.data or str(
            make_data(Path(tmp) / "data.jsonl", rows=64, seq_len=args.seq_len, vocab=SMOL_SHAPES["vocab"])
        )
        timed = {s: measure_speed(model, s, args.batch_size, args.seq_len) for s in speeds}
        print(f"one layer's attention, batch {args.batch_size} x {args.seq_len}, forward + backward + AdamW")
        print_segments(speeds, timed)
        if args.ab_rounds:
            run_ab(model, data, speeds, args.ab_rounds, args.steps, args.batch_size, args.seq_len)


if __name__ == "__main__":
    main()
