"""Replay a bench's `xronos` rounds offline: what their profiles decided, and what else they predicted.

For each round in the JSON of `xronos bench --json` (its `round_reports`): each device's profiled
collective cost (what decides who takes part), the predicted step with every device and with the
last one (listed last in `--speeds`: the slowest in the README's benches) left out, and, on the profiles as the round's re-plan checks left them (replayed through
`replan` along the splits the round really ran), the split it ended on as those profiles predict it
(each device's compute and the idle they leave: what the plan chose, beside what was measured),
the best plan with and without the LM head's weight-gradient products moved
(`vocab_weight_grad_fraction` set to 0), and with `--attention`, the best split beside each given
attention layout (whole KV groups per device, rank order) with its step and idle. Pure arithmetic on
the recorded profiles and measurements: it runs nothing. Not a test: numbers, to be quoted.

    python benchmarks/replay_bench.py strong.json --model M --attention 3/0/0,2/1/0
"""

from __future__ import annotations

import argparse
import json

from edge_node.model_io import load_config
from xronos.contract.profiles import DeviceProfile
from xronos.contract.report import RunReport, mean_idle_ratio
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.cost_model import collective_seconds, device_compute, split_step_seconds
from xronos.planner.layouts import best_split_with_attention
from xronos.planner.partitioner import plan_partition, solve_members
from xronos.planner.replan import MeasuredCompute, replan


def final_profiles(report: RunReport, dims: ModelDims, micro_batch: int, seq_len: int) -> list[DeviceProfile]:
    """The participants' profiles as the round's last check recalibrated them (rank order)."""
    plan = plan_partition(report.profiles, dims, micro_batch, seq_len)
    profiles = [report.profiles[i] for i, d in enumerate(plan.devices) if d.rank is not None]
    split = plan.split
    for check in report.replans:
        measured = [
            MeasuredCompute(t, tuple(s))
            for t, s in zip(
                check.measured_compute_seconds, check.measured_segment_seconds or [(0.0,) * 3] * len(profiles)
            )
        ]
        profiles = replan(profiles, dims, split, measured, micro_batch, seq_len).profiles
        split = check.new_split or split
    return profiles


def predicted(profiles: list[DeviceProfile], dims: ModelDims, split: ShardSplit) -> str:
    """Each device's compute, the step and the idle that `profiles` predict for `split`."""
    compute = [device_compute(p, dims, *share) for p, share in zip(profiles, split.shares())]
    step = split_step_seconds(profiles, dims, split)
    return f"compute {'/'.join(f'{c:.2f}' for c in compute)} s, step {step:.3f} s, idle {mean_idle_ratio(compute, step):.1%}"


def layouts(text: str) -> list[list[int]]:
    """'3/0/0,2/1/0' -> [[3, 0, 0], [2, 1, 0]]."""
    try:
        return [[int(k) for k in item.split("/")] for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"bad --attention {text!r}: use KV groups per device, e.g. 3/0/0,2/1/0"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench_json")
    parser.add_argument("--model", required=True, help="the model directory the bench trained")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per micro-step of the bench")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--attention",
        type=layouts,
        help="attention layouts to price on each round's final profiles, "
        "e.g. 3/0/0,2/1/0 (rounds with another number of devices skip them)",
    )
    args = parser.parse_args()
    dims = ModelDims.from_config(load_config(args.model))
    data = json.loads(open(args.bench_json).read())
    for k, raw in enumerate(data.get("round_reports", {}).get("xronos") or [data["reports"]["xronos"]]):
        report = RunReport.model_validate(raw)
        every = list(range(len(report.profiles)))
        coll = " ".join(f"{collective_seconds(p, dims) * 1e3:.0f}" for p in report.profiles)
        all_in = solve_members(report.profiles, dims, every, args.batch_size)[0]
        without = solve_members(report.profiles, dims, every[:-1], args.batch_size)[0]
        print(
            f"round {k + 1}: ran {report.split.describe()}, idle {report.idle_ratio:.1%}; collective ms/step {coll}; "
            f"predicted step, all devices {all_in:.3f} s, the last left out {without:.3f} s"
        )
        final = final_profiles(report, dims, args.batch_size, args.seq_len)
        print(f"  final profiles on the split it ran: {predicted(final, dims, report.split)}")
        for layout in args.attention or []:
            if len(layout) == len(final):
                split = best_split_with_attention(final, dims, layout)
                print(
                    f"  final profiles, kv {'/'.join(map(str, layout))} fixed: {split.describe()}  {predicted(final, dims, split)}"
                )
        for label, profiles in (
            ("moves", final),
            ("no moves", [p.model_copy(update={"vocab_weight_grad_fraction": 0.0}) for p in final]),
        ):
            plan = plan_partition(profiles, dims, args.batch_size, args.seq_len)
            print(
                f"  final profiles, {label:>8}: {plan.split.describe()}  step {plan.predicted_step_seconds:.3f} s, "
                f"idle {plan.predicted_idle_ratio:.1%}"
            )


if __name__ == "__main__":
    main()
