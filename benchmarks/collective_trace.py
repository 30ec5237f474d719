"""Where the ranks' time in collectives goes, collective by collective: waiting for a later rank, or after the last.

Runs `xronos run` with the arguments after `--` and `XRONOS_COLLECTIVE_TRACE` set, so that each rank writes
every all-reduce of its training with its start, its end and whether it sent a part (`Trainer.write_trace`; the
host's monotonic clock, so the ranks of one machine line up call by call), or reads such a directory
(`--trace`). For the last `--last` steps (after any re-shard: the split they ran is the job's last), every
collective is split per rank into the wait for a later rank (the last of the ranks that sent a part: one
that holds none of the segment only receives, and nobody waits for it), and what came after it arrived (the
bytes moved, the sum, and a throttled rank's wait for its next quota period). Prints, per
rank and step, the seconds in each; and by segment and direction (the attention's, the MLP's and the
vocabulary's collectives, forward then backward, in the order a step runs them; the others by position),
each rank's compute before the collective (since its previous one ended), its wait per call, the time after
the last arrival, and how often each rank came last: a segment balanced as a whole but not by direction
shows as one rank's longer compute forward and another's backward.

It answers what a cheaper collective could buy: only the time after the last arrival is the collective's
own; the wait is a balance (or a throttled rank's lag), which moving bytes faster does not shorten. Not a test:
numbers, to be quoted. Example (speeds 1, 0.5, 0.25, the planner's split, SmolLM2 as the README makes it):

    python benchmarks/collective_trace.py -- --model smol --data kjv/train.txt --nodes 3 --speeds 1,0.5,0.25 \\
        --mode xronos --steps 16 --batch-size 4 --seq-len 128 --output runs/trace --quiet --no-head-start
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

SEGMENTS = ("kv_groups", "mlp_columns", "vocab_rows")
NAMES = {"kv_groups": "attention", "mlp_columns": "MLP", "vocab_rows": "vocabulary"}


def load(directory: Path) -> list[dict]:
    ranks = sorted((json.loads(p.read_text()) for p in directory.glob("rank-*.json")), key=lambda r: r["rank"])
    if len(ranks) < 2:
        raise SystemExit(f"{directory}: traces of at least two ranks needed, found {len(ranks)}")
    if len({len(r["calls"]) for r in ranks}) != 1 or len({tuple(r["steps"]) for r in ranks}) != 1:
        raise SystemExit(f"{directory}: the ranks' traces do not list the same collectives")
    return ranks


def label_step(closes: list[str | None]) -> list[str]:
    """Each collective of one step named by its segment and direction: a layer segment's first half of
    collectives is the forward pass's (one per layer), its second the backward's; the vocabulary's last is its
    backward (the final norm's gradient), the ones before it the loss's forward (`causal_lm_loss`); the others
    by their position in the step."""
    totals = {s: closes.count(s) for s in SEGMENTS}
    seen: dict[str | None, int] = defaultdict(int)
    labels = []
    for position, segment in enumerate(closes):
        k = seen[segment]
        seen[segment] += 1
        if segment in ("kv_groups", "mlp_columns") and totals[segment] % 2 == 0:
            labels.append(f"{NAMES[segment]} {'forward' if k < totals[segment] // 2 else 'backward'}")
        elif segment == "vocab_rows":
            labels.append(f"vocabulary forward #{k}" if k < totals[segment] - 1 else "vocabulary backward")
        elif segment is not None:
            labels.append(f"{segment} #{k}")
        else:
            labels.append(f"other @{position}")
    return labels


def analyse(ranks: list[dict], last: int) -> None:
    steps = ranks[0]["steps"]
    n_calls = len(ranks[0]["calls"])
    bounds = list(zip(steps, steps[1:] + [n_calls]))[-last:]
    world = len(ranks)
    speeds = ", ".join(f"{r['rank']} [{r['speed']}]" for r in ranks)
    per_step = {b - a for a, b in bounds}
    print(f"ranks {speeds}; the last {len(bounds)} of {len(steps)} steps; collectives a step: {sorted(per_step)}")
    wait = [[0.0] * len(bounds) for _ in ranks]
    after = [[0.0] * len(bounds) for _ in ranks]
    by_label: dict[str, dict] = {}
    order: list[str] = []
    for s, (a, b) in enumerate(bounds):
        labels = label_step([ranks[0]["calls"][i][0] for i in range(a, b)])
        for i, label in zip(range(a, b), labels):
            starts = [r["calls"][i][1] for r in ranks]
            ends = [r["calls"][i][2] for r in ranks]
            last_in = max(start for r, start in zip(ranks, starts) if r["calls"][i][3])
            entry = by_label.setdefault(
                label, {"calls": 0, "compute": [0.0] * world, "wait": [0.0] * world, "after": 0.0, "last": [0] * world}
            )
            if label not in order:
                order.append(label)
            entry["calls"] += 1
            entry["last"][starts.index(last_in)] += 1
            entry["after"] += max(e - last_in for e in ends)
            for r in range(world):
                if i > 0:  # the rank's compute since its previous collective ended (the step's first: AdamW too)
                    entry["compute"][r] += starts[r] - ranks[r]["calls"][i - 1][2]
                waited = max(0.0, last_in - starts[r])
                wait[r][s] += waited
                after[r][s] += ends[r] - max(starts[r], last_in)
                entry["wait"][r] += waited
    print("\nper step, seconds (median over the steps): rank: waiting for a later rank + after the last arrival")
    for r, rank in enumerate(ranks):
        w, x = statistics.median(wait[r]), statistics.median(after[r])
        print(f"  rank {rank['rank']} [{rank['speed']}]: {w:.3f} + {x:.3f} = {w + x:.3f}")
    print("\nby collective (ms per call, means): calls a step | each rank's compute before it | each rank's wait for")
    print(
        "a later rank | after the last sender's arrival (the slowest rank's) | each rank the last sender in, % of calls"
    )
    for label in order:
        e = by_label[label]
        c = e["calls"]
        compute = " ".join(f"{1e3 * t / c:6.1f}" for t in e["compute"])
        waits = " ".join(f"{1e3 * w / c:6.2f}" for w in e["wait"])
        lasts = " ".join(f"{100 * k / c:3.0f}" for k in e["last"])
        print(f"  {label:22s} {c / len(bounds):4.0f} | {compute} | {waits} | {1e3 * e['after'] / c:6.2f} | {lasts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace", type=Path, help="the traces' directory: read it (alone), or where the run writes (with -- ARGS)"
    )
    parser.add_argument("--last", type=int, default=8, help="the steps to analyse, from the end (default 8)")
    parser.add_argument("run", nargs=argparse.REMAINDER, help="-- then the arguments of `xronos run`")
    args = parser.parse_args()
    run = args.run[1:] if args.run[:1] == ["--"] else args.run
    if args.trace is None and not run:
        parser.error("give `--trace DIR` or `-- ARGS` for `xronos run`")
    directory = args.trace or Path(tempfile.mkdtemp(prefix="xronos-trace-"))
    if run:
        env = dict(os.environ, XRONOS_COLLECTIVE_TRACE=str(directory), HF_HUB_OFFLINE="1")
        subprocess.run([sys.executable, "-m", "xronos.cli", "run", *run], env=env, check=True)
        print(f"traces in {directory}")
    analyse(load(directory), max(1, args.last))


if __name__ == "__main__":
    main()
