"""Where one step's time goes, and where a whole job's goes (issue 36, item 1).

For one model and batch shape, runs `xronos run` as a user would (one command each, its wall
time from start to saved model): `single` (the plain HF model on one device at speed 1), the TP
engine at world size 1 (`--mode tp --nodes 1`), and `xronos` on 2 devices (speeds 1, 0.5) and on
3 (speeds 1, 0.5, 0.25). Prints:

1. the per-step breakdown: each device's compute in the attention, MLP and vocabulary
   segments, the rest of its compute (embedding, AdamW, the framework's Python: step - comm -
   segments), its time in collectives and, of that, its idle; then the shards' compute summed
   (raw, and scaled by each device's speed to one speed-1 core) beside the plain model's.
   The TP modes on several ranks time their segments themselves (`RankResult.segment_seconds`,
   from the collectives that close them); a rank alone has no collectives, so for `single` and
   `tp` on one rank the segments come from a separate in-process timing of the same model under
   forward and backward hooks, one thread, unthrottled (a speed-1 device is one whole core);
2. the job timeline: when each start-up phase ended (`RankResult.timeline`), in seconds since
   the command started, for `single` and `xronos`, with the command's whole wall time;
3. the first two steps against the steady median (the slowest device's wall time).

Stand-alone and asserts nothing about time; the machine may be shared, so read it over
`--rounds`. Example:

    python benchmarks/step_breakdown.py --steps 50 --rounds 1
    python benchmarks/step_breakdown.py --model smollm2 --batch-size 4 --seq-len 128 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from edge_node.toy_model import make_data, make_model
from xronos.contract.report import TIMELINE_EVENTS

RUNS = [  # label, mode, nodes, speeds
    ("single", "single", 1, [1.0]),
    ("tp x1", "tp", 1, [1.0]),
    ("xronos x2", "xronos", 2, [1.0, 0.5]),
    ("xronos x3", "xronos", 3, [1.0, 0.5, 0.25]),
]
PHASES = list(TIMELINE_EVENTS)
TOY = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536, vocab=8192, tie=False)


def inputs(args, root: Path) -> tuple[Path, Path]:
    """(model directory, data file): the toy model by default, SmolLM2-135M with `--model smollm2`."""
    if args.model == "smollm2":
        from edge_node.corpora import write_kjv_text
        from edge_node.gguf_import import import_gguf, locate_smollm2_gguf

        model = import_gguf(locate_smollm2_gguf(), root / "smol")
        data = Path(args.data) if args.data else write_kjv_text(root / "kjv")[0]
        return model, data
    model = Path(args.model) if args.model else make_model(root / "model", **TOY, seed=1)
    if args.data:
        return model, Path(args.data)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rows = args.batch_size * (args.steps + 2)
    return model, make_data(root / "data.jsonl", rows=rows, seq_len=args.seq_len + 1, vocab=vocab, seed=3)


def run_job(args, model: Path, data: Path, root: Path, label: str, mode: str, nodes: int, speeds) -> dict:
    """One `xronos run`, as a command: its report, with the command's start and wall time."""
    tag = label.replace(" ", "")
    report = root / f"{tag}.json"
    command = [sys.executable, "-m", "xronos.cli", "run", "--model", str(model), "--data", str(data)]
    command += ["--mode", mode, "--nodes", str(nodes), "--speeds", ",".join(map(str, speeds))]
    command += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len)]
    command += ["--output", str(root / f"out-{tag}"), "--report", str(report), "--seed", "7"]
    started = time.time()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.time() - started
    return {"label": label, "speeds": speeds, "started": started, "wall": wall, **json.loads(report.read_text())}


# -- in-process segment timing of a model alone (single, tp on one rank) ------------------------
class SegmentTimer:
    """Forward and backward seconds of a Llama-layout model's segments, by module hooks.

    attention = input norm + self-attention, MLP = post-attention norm + MLP (as the TP engine's
    segments, which run from one collective to the next); vocabulary = final norm, LM head and
    loss forward, and their backward up to the final norm's input gradient."""

    def __init__(self, model):
        self.seconds: dict[str, float] = defaultdict(float)
        self.open: dict[str, float] = {}
        inner = model.model if hasattr(model, "model") else model.base_model
        for layer in inner.layers:
            for first, last, name in ((layer.input_layernorm, layer.self_attn, "attn"),
                                      (layer.post_attention_layernorm, layer.mlp, "mlp")):  # fmt: skip
                first.register_forward_pre_hook(partial(self.entered, name))
                last.register_forward_hook(partial(self.left, name))
        inner.norm.register_forward_pre_hook(partial(self.entered, "vocab"))

    def entered(self, name: str, module, args) -> None:
        """Forward: the segment starts; backward: it ends when its input's gradient is computed."""
        self.start(name)
        args[0].register_hook(lambda _: self.stop(name))

    def left(self, name: str, module, args, output) -> None:
        """Forward: the segment ends; backward: it starts when its output's gradient arrives."""
        self.stop(name)
        (output[0] if isinstance(output, tuple) else output).register_hook(lambda _: self.start(name))

    def start(self, name: str) -> None:
        self.open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        self.seconds[name] += time.perf_counter() - self.open.pop(name)


def time_alone(model_dir: Path, data: Path, args, tensor_parallel: bool, steps: int = 8) -> dict[str, float]:
    """Mean seconds per step of each segment, AdamW and the rest, of the plain model or the TP
    engine's one-rank shard, one thread, over `steps` steps after two warm-up steps."""
    from edge_node.data import load_rows
    from edge_node.model_io import load_config, load_full, load_shard
    from edge_node.optimizer import adamw
    from edge_node.tp.context import TPContext
    from edge_node.tp.cross_entropy import causal_lm_loss
    from xronos.contract.splits import ModelDims
    from xronos.planner.planning import split_for_mode

    torch.set_num_threads(1)
    torch.manual_seed(7)
    tp = TPContext()
    config = load_config(model_dir)
    if tensor_parallel:
        split = split_for_mode("tp", ModelDims.from_config(config), 1, [1.0])
        model = load_shard(model_dir, split, 0, tp)
    else:
        model = load_full(model_dir)
    model.train()
    optimizer = adamw(model.parameters(), 1e-4)
    rows = load_rows(data, args.seq_len, model_dir, config.vocab_size)
    timer = SegmentTimer(model)
    totals: dict[str, float] = defaultdict(float)
    for step in range(steps + 2):
        if step == 2:
            timer.seconds.clear()
            totals.clear()
        ids = rows[(step * args.batch_size) % (len(rows) - args.batch_size) :][: args.batch_size]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if tensor_parallel:
            loss = causal_lm_loss(model(input_ids=ids, use_cache=False).logits, ids, 0, tp)
        else:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        timer.stop("vocab")
        timer.start("vocab")
        loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        t2 = time.perf_counter()
        totals["adamw"] += t2 - t1
        totals["step"] += t2 - t0
    out = {k: v / steps for k, v in {**timer.seconds, **totals}.items()}
    out["other"] = out["step"] - out["attn"] - out["mlp"] - out["vocab"] - out["adamw"]
    return out


# -- tables --------------------------------------------------------------------------------------
def breakdown_rows(run: dict, alone: dict[str, float] | None) -> list[list[str]]:
    n = run["measured_steps"]
    rows = []
    for node in run["nodes"]:
        compute, comm, idle = node["compute_seconds"] / n, node["comm_seconds"] / n, node["idle_seconds"] / n
        if node.get("segment_seconds"):
            attn, mlp, vocab = (s / n for s in node["segment_seconds"])
            rest = f"{compute - attn - mlp - vocab:.3f}"
        elif alone is not None:
            attn, mlp, vocab = alone["attn"], alone["mlp"], alone["vocab"]
            rest = f"{alone['adamw']:.3f} + {alone['other']:.3f}*"
        else:
            attn = mlp = vocab = float("nan")
            rest = ""
        speed = node["speed"] or 1.0
        rows.append(
            [
                run["label"] + ("*" if alone is not None else ""),
                f"d{node['device']} @{speed:g}",
                f"{node['kv_groups']}/{node['mlp_columns']}/{node['vocab_rows']}",
                f"{attn:.3f}",
                f"{mlp:.3f}",
                f"{vocab:.3f}",
                rest,
                f"{compute:.3f}",
                f"{comm:.3f}",
                f"{idle:.3f}",
                f"{run['mean_step_seconds']:.3f}",
            ]
        )
    if len(run["nodes"]) > 1 and all(node.get("segment_seconds") for node in run["nodes"]):
        segs = [[s / n for s in node["segment_seconds"]] for node in run["nodes"]]
        scaled = [[s * (node["speed"] or 1.0) for s in seg] for seg, node in zip(segs, run["nodes"])]
        computes = [node["compute_seconds"] / n for node in run["nodes"]]
        for what, table in (("sum", segs), ("sum x speed", scaled)):
            factor = [1.0] * len(computes) if what == "sum" else [node["speed"] or 1.0 for node in run["nodes"]]
            rows.append(
                [run["label"], what, "", *(f"{sum(col):.3f}" for col in zip(*table)), ""]
                + [f"{sum(c * f for c, f in zip(computes, factor)):.3f}", "", "", ""]
            )
    return rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def timeline_table(runs: list[dict]) -> str:
    columns, cells = [], {}
    for run in runs:
        if run["mode"] == "tp":
            continue
        for node in run["nodes"]:
            key = f"{run['label']} d{node['device']}"
            columns.append(key)
            offset = (node.get("started_at") or run["started"]) - run["started"]
            cells[(key, "worker started")] = f"{offset:.2f}"
            for event in node.get("timeline", []):
                mark = f"{offset + event['at_seconds']:.2f}"
                if event.get("seconds") is not None:
                    mark += f" ({event['seconds']:.2f} s)"
                cell = cells.get((key, event["name"]))
                cells[(key, event["name"])] = mark if cell is None else f"{cell}, {mark}"
            cells[(key, "command done")] = f"{run['wall']:.2f}"
    names = ["worker started", *PHASES, "command done"]
    rows = [[name, *(cells.get((c, name), "") for c in columns)] for name in names]
    return markdown(["s since the command started", *columns], [r for r in rows if any(r[1:])])


def first_steps_table(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        steps = run["step_seconds"]
        steady = statistics.median(steps[2:]) if len(steps) > 2 else float("nan")
        extra = steps[0] + steps[1] - 2 * steady
        rows.append(
            [
                run["label"],
                f"{steps[0]:.3f}",
                f"{steps[1]:.3f}",
                f"{steady:.3f}",
                f"{steps[0] / steady:.2f}x / {steps[1] / steady:.2f}x",
                f"{extra:.2f}",
                f"{run['wall']:.1f}",
            ]
        )
    header = ["run", "step 1 s", "step 2 s", "steady median s", "vs steady", "extra s", "command s"]
    return markdown(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a model directory, or 'smollm2' (default: a toy Llama made here)")
    parser.add_argument("--data", help="JSONL rows or a text file (default: rows made here)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument(
        "--runs", default=",".join(r[0] for r in RUNS), help="which of: " + ", ".join(r[0] for r in RUNS)
    )
    parser.add_argument("--json", help="write every round's reports here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wanted = [r for r in RUNS if r[0] in args.runs.split(",")]
    everything = []
    with tempfile.TemporaryDirectory(prefix="step-breakdown-") as tmp:
        root = Path(tmp)
        model, data = inputs(args, root)
        for round_ in range(args.rounds):
            runs = [run_job(args, model, data, root, *r) for r in wanted]
            alone = {
                "single": time_alone(model, data, args, tensor_parallel=False),
                "tp": time_alone(model, data, args, tensor_parallel=True),
            }
            everything.append(runs)
            print(f"\n## round {round_ + 1} of {args.rounds}: {args.steps} steps of {args.batch_size} x {args.seq_len}")
            header = ["run", "device", "kv/mlp/vocab", "attn s", "mlp s", "vocab s", "other s", "compute s"]
            header += ["comm s", "idle s", "step s"]
            rows = [row for run in runs for row in breakdown_rows(run, alone.get(run["mode"]))]
            print("\n### per step\n\n" + markdown(header, rows))
            print("\n### job timeline\n\n" + timeline_table(runs))
            print("\n### first steps\n\n" + first_steps_table(runs))
            for run in runs:
                if run["mode"] == "xronos":
                    chosen = f"{len(run['nodes'])} of {len(run['speeds'])} devices"
                    print(f"\n{run['label']}: {chosen}, split {run.get('split')}, re-plans {len(run['replans'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
