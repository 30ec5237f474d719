"""`xronos bench`: the modes side by side on one emulated cluster, one command.

Every mode trains the same model on the same data with the same optimizer
and the same emulated devices; the table compares step time (and its ratio
to even TP and to the compute-only ideal), idle ratio, and held-out
perplexity before and after. A PNG chart shows step time per mode and where
each device's time goes (compute, communication, idle).

Beside the modes, the reference `hf-tp` (`edge_node.hf_tp`): transformers' own tensor
parallelism on the same devices, quotas and rows; a run label of the bench, not a job mode.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from pydantic import BaseModel

from edge_node.data import load_rows
from edge_node.evaluate import perplexity
from edge_node.hf_tp import HF_TP, run_hf_tp
from edge_node.launcher import run_local
from edge_node.model_io import load_config
from xronos.contract.errors import XronosError
from xronos.contract.job import MODES, JobOptions
from xronos.contract.report import RunReport, describe_layout
from xronos.contract.splits import ModelDims
from xronos.summary import head_start_text, node_seconds, replan_lines

BENCH_MODES: tuple[str, ...] = (*MODES, HF_TP)
"""What `--modes` takes: the job modes, and transformers' TP as a reference (not in the default: its
steps are several times tp's)."""


class BenchResult(BaseModel):
    speeds: list[float]
    perplexity_before: float | None
    perplexity_after: dict[str, float]
    reports: dict[str, RunReport]
    """Per mode, the report of its median round."""
    rounds: dict[str, list[float]]
    """Per mode, the mean step seconds of each round, in round order."""
    round_idle: dict[str, list[float]] = {}
    """Per mode, each round's idle ratio, in round order."""
    round_layouts: dict[str, list[str]] = {}
    """Per mode, each round's layout (its final split, or its stages), in round order: a profiled
    mode plans from fresh measurements every round, and its plan may differ between them."""
    round_reports: dict[str, list[RunReport]] = {}
    """With several rounds, per mode, every round's whole report, in round order (the median round's
    is also in `reports`): a round whose idle or plan stands out can be traced (its re-plan checks,
    per-device seconds, the profiles it planned with: `xronos plan --profiles` takes one saved alone)."""
    failed: dict[str, str] = {}
    """Per run label that could not run (the reference hf-tp, on a model its plan cannot split), why."""


def layouts_by_round(layouts: list[str], idle: list[float]) -> str | None:
    """One line of each round's layout and idle, or None when every round had the same layout."""
    if len(set(layouts)) <= 1:
        return None
    return "; ".join(f"{k + 1}: {layout} (idle {ratio:.1%})" for k, (layout, ratio) in enumerate(zip(layouts, idle)))


def idle_summary(xronos: float, tp: float, planned: float | None, round_idle: dict[str, list[float]]) -> str:
    """xronos's idle ratio beside tp's: the median round's (the table's) and what the plan predicted,
    and with several rounds each round's and the mean over rounds (one round's idle is one sample of
    a drifting machine; the mean over rounds is the steadier figure)."""
    line = f"idle: xronos {xronos:.1%}" + (f" (its plan predicted {planned:.1%})" if planned is not None else "")
    line += f", tp {tp:.1%} ({tp / xronos:.1f}x less)"
    xs, ts = round_idle.get("xronos", []), round_idle.get("tp", [])
    if len(xs) > 1:  # a bench runs every mode once per round
        mx, mt = statistics.fmean(xs), statistics.fmean(ts)
        line += (
            f"; by round xronos {' '.join(f'{r:.1%}' for r in xs)}, tp {' '.join(f'{r:.1%}' for r in ts)};"
            f" mean over rounds xronos {mx:.1%}, tp {mt:.1%}" + (f" ({mt / mx:.1f}x less)" if mx > 0 else "")
        )
    return line


def median_round(seconds: list[float]) -> int:
    """The round whose step time is the median (of an even number, the lower middle one)."""
    order = sorted(range(len(seconds)), key=seconds.__getitem__)
    return order[(len(seconds) - 1) // 2]


def round_ratios(rounds: dict[str, list[float]], mode: str, base: str) -> list[float]:
    """`mode`'s step time over `base`'s, round by round: each pair ran minutes apart, not rounds apart."""
    return [a / b for a, b in zip(rounds[mode], rounds[base])]


def loss_difference(losses: list[float], reference: list[float]) -> float:
    """The largest relative difference between two runs' losses, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def bench_runs(modes: list[str], pp_micro_batches: list[int] | None) -> list[tuple[str, str, int | None]]:
    """(label, mode, micro-batches) of each run: `pp` once per micro-batch count asked for.

    PP's best micro-batch count is a trade the profiles cannot see (more micro-batches
    shrink the bubble but make every matmul and message smaller), so the bench tunes it
    the direct way: by running each.
    """
    runs: list[tuple[str, str, int | None]] = []
    for mode in modes:
        if mode == "pp" and pp_micro_batches and len(pp_micro_batches) > 1:
            runs += [(f"pp m={m}", mode, m) for m in pp_micro_batches]
        else:
            runs.append((mode, mode, pp_micro_batches[0] if mode == "pp" and pp_micro_batches else None))
    return runs


def run_bench(
    base: JobOptions,
    modes: list[str],
    speeds: list[float],
    eval_data: str | None,
    eval_rows: int,
    show_progress: bool = True,
    pp_micro_batches: list[int] | None = None,
    rounds: int = 1,
) -> BenchResult:
    """Every mode once per round, the modes in turn within a round.

    A shared machine's pace drifts by tens of percent over minutes; rounds interleave the
    modes so each sees the same drift, and the table shows each mode's median round and
    the round-by-round ratios. Training is deterministic, so perplexity is taken once.
    """
    eval_set = None
    if eval_data:
        dims = ModelDims.from_config(load_config(base.model))
        eval_set = load_rows(eval_data, base.seq_len, base.model, dims.vocab_size)[:eval_rows]
    before = perplexity(base.model, eval_set) if eval_set is not None else None
    runs: dict[str, list[RunReport]] = {}
    after: dict[str, float] = {}
    failed: dict[str, str] = {}
    for round_ in range(rounds):
        for label, mode, micro_batches in bench_runs(modes, pp_micro_batches):
            out = Path(base.output) / label.replace(" ", "_").replace("=", "")
            if mode == HF_TP:
                if label not in failed:
                    of = f" (round {round_ + 1} of {rounds})" if rounds > 1 else ""
                    _run_reference(
                        base.model_copy(update={"output": str(out)}), speeds, runs, failed, show_progress, of
                    )
                continue
            job = base.model_copy(
                update={"mode": mode, "output": str(out), "micro_batches": micro_batches or base.micro_batches}
            )
            nodes, node_speeds = (1, [1.0]) if mode == "single" else (len(speeds), speeds)
            print(
                f"bench: {label} on {nodes} device(s) at speeds {node_speeds}"
                + (f" (round {round_ + 1} of {rounds})" if rounds > 1 else ""),
                flush=True,
            )
            # The previous run's model (hundreds of MB) is still dirty in the page cache; written back
            # during this run, it would take CPU from this run's first steps. Every run starts clean.
            os.sync()
            runs.setdefault(label, []).append(run_local(job, nodes, node_speeds, show_progress=show_progress))
            if eval_set is not None and round_ == 0:
                after[label] = perplexity(out, eval_set)
    if not runs:  # hf-tp alone, and it could not run
        raise XronosError("; ".join(f"{label} cannot run: {why}" for label, why in failed.items()))
    seconds = {label: [r.mean_step_seconds for r in reports] for label, reports in runs.items()}
    reports = {label: runs[label][median_round(seconds[label])] for label in runs}
    return BenchResult(
        speeds=speeds,
        perplexity_before=before,
        perplexity_after=after,
        reports=reports,
        rounds=seconds,
        round_idle={label: [r.idle_ratio for r in rs] for label, rs in runs.items()},
        round_layouts={label: [describe_layout(r.split, r.stages) for r in rs] for label, rs in runs.items()},
        round_reports=runs if rounds > 1 else {},
        failed=failed,
    )


def _run_reference(
    job: JobOptions,
    speeds: list[float],
    runs: dict[str, list[RunReport]],
    failed: dict[str, str],
    show_progress: bool,
    round_text: str,
) -> None:
    """One round of hf-tp into `runs`, or why it cannot run into `failed` (the other modes run on)."""
    print(
        f"bench: {HF_TP} (transformers' tp_plan) on {len(speeds)} device(s) at speeds {speeds}{round_text}", flush=True
    )
    os.sync()
    try:
        runs.setdefault(HF_TP, []).append(run_hf_tp(job, speeds, show_progress=show_progress))
    except XronosError as err:
        failed[HF_TP] = str(err)
        runs.pop(HF_TP, None)
        print(f"bench: {HF_TP} failed: {err}", flush=True)


def compute_stall(node, measured_steps: int) -> float:
    """Compute time lost to sharing the cores with communication: measured over profiled, minus 1."""
    return node.compute_seconds / measured_steps / node.predicted_compute_seconds - 1


def checked_step_seconds(report: RunReport) -> float | None:
    """The median prediction of the re-plan checks that priced the split the job ended on (from the last
    re-shard on), each with the devices' paces as the job had measured them by then (a machine's pace
    drifts over a job, so one check's window is not the measured steps'); None without any."""
    moved = [k for k, c in enumerate(report.replans) if c.new_split is not None]
    final = report.replans[moved[-1] if moved else 0 :]
    checked = [c.predicted_step_seconds for c in final if c.predicted_step_seconds]
    return statistics.median(checked) if checked else None


def _median_range(values: list[float]) -> str:
    text = f"{statistics.median(values):.2f}"
    return text if len(values) == 1 else f"{text} ({min(values):.2f}-{max(values):.2f})"


def prediction_text(reports: list[RunReport]) -> str | None:
    """A mode's predicted / measured step over its rounds, median (range): the plan's prediction, and
    ', C after the re-plan checks' (`checked_step_seconds`) where the job checked; None: never predicted."""
    planned = [r.predicted_step_seconds / r.mean_step_seconds for r in reports if r.predicted_step_seconds]
    if not planned:
        return None
    checked = [c / r.mean_step_seconds for r in reports if (c := checked_step_seconds(r))]
    return _median_range(planned) + (f", {_median_range(checked)} after the re-plan checks" if checked else "")


def _ratio_text(rounds: dict[str, list[float]], mode: str, base: str) -> str:
    """The median round-by-round ratio, with its range when there were several rounds."""
    return _median_range(round_ratios(rounds, mode, base))


def _layout(label: str, r: RunReport) -> str:
    text = describe_layout(r.split, r.stages)
    return f"tp_plan auto: {text}" if label == HF_TP else text


def print_bench(result: BenchResult) -> None:
    reports, rounds = result.reports, result.rounds
    n_rounds = len(next(iter(rounds.values())))
    single = reports.get("single")
    ideal = single.mean_step_seconds / sum(result.speeds) if single else None
    print(
        f"\nspeeds {result.speeds} (sum {sum(result.speeds):g})"
        + (f"; compute-only ideal {ideal:.3f} s/step (single-core step / sum of speeds)" if ideal else "")
        + (
            f"; {n_rounds} rounds: each mode's median round, ratios round by round: median (range)"
            if n_rounds > 1
            else ""
        )
    )
    ppl0 = f"{result.perplexity_before:.3f}" if result.perplexity_before else "-"
    width = 17 if n_rounds > 1 else 6
    print(
        f"{'mode':<8} {'step s':>7} {'vs tp':>{width}} {'vs ideal':>8} {'idle':>6} {'ppl before':>10} {'ppl after':>9}  split"
    )
    for mode, r in reports.items():
        vs_tp = _ratio_text(rounds, mode, "tp") if "tp" in reports else "-"
        vs_ideal = f"{r.mean_step_seconds / ideal:.2f}" if ideal else "-"
        ppl = f"{result.perplexity_after[mode]:.3f}" if mode in result.perplexity_after else "-"
        idle = "-" if mode == HF_TP else f"{r.idle_ratio:.1%}"  # its collectives are not timed
        print(
            f"{mode:<8} {r.mean_step_seconds:>7.3f} {vs_tp:>{width}} {vs_ideal:>8} {idle:>6} {ppl0:>10} {ppl:>9}  {_layout(mode, r)}"
        )
    for label, why in result.failed.items():
        print(f"{label:<8} failed: {why}")
    if HF_TP in reports and "single" in reports:
        diff = loss_difference(reports[HF_TP].losses, reports["single"].losses)
        print(f"{HF_TP} losses vs single, step by step: max relative difference {diff:.1e}")
    if "single" in reports and len(reports) > 1:
        print(
            "step / single's (the fastest device alone), round by round: "
            + "; ".join(f"{m} {_ratio_text(rounds, m, 'single')}" for m in reports if m != "single")
        )
    predicted = {m: prediction_text(result.round_reports.get(m, [r])) for m, r in reports.items()}
    if any(predicted.values()):
        print(
            "predicted / measured step, round by round: median (range): "
            + "; ".join(f"{m} {text}" for m, text in predicted.items() if text)
        )
    jobs = {
        m: [r.job_seconds for r in result.round_reports.get(m, [rep]) if r.job_seconds] for m, rep in reports.items()
    }
    if "single" in jobs and jobs["single"]:
        print(
            "\nwhole job s (the launcher's start to the saved model: start-up, profiling, planning, steps, save),"
            " by round, and / single's round by round: "
            + "; ".join(
                f"{m} "
                + " ".join(f"{s:.1f}" for s in js)
                + (f" ({_ratio_text(jobs, m, 'single')})" if m != "single" and len(js) == len(jobs["single"]) else "")
                for m, js in jobs.items()
                if js
            )
        )
    if n_rounds > 1:
        print(
            "\nstep seconds by round: "
            + "; ".join(f"{mode} " + " ".join(f"{s:.2f}" for s in seconds) for mode, seconds in rounds.items())
        )
        for mode, layouts in result.round_layouts.items():
            line = layouts_by_round(layouts, result.round_idle[mode])
            if line:
                print(f"{mode} layouts by round: {line}")
    print(
        "\nper device [speed], seconds per measured step: compute / comm / idle"
        " (profiled modes: + compute stall = measured / profiled compute - 1; TP modes: + wait at"
        " segment ends, inside comm)"
    )
    for mode, r in reports.items():
        if mode == HF_TP:
            steps = "  ".join(f"[{n.speed:g}] step {n.compute_seconds / r.measured_steps:.2f}" for n in r.nodes)
            print(f"{mode:<8} {steps}  (collectives inside DTensor's ops: not timed)")
            continue
        per = "  ".join(
            node_seconds(n, r.measured_steps)
            + (f" stall {compute_stall(n, r.measured_steps):+.0%}" if n.predicted_compute_seconds else "")
            + (f" wait {n.segment_wait_seconds / r.measured_steps:.2f}" if n.segment_wait_seconds is not None else "")
            for n in r.nodes
        )
        left_out = "".join(f"  [{e.speed:g}] left out: {e.reason}" for e in r.excluded)
        print(f"{mode:<8} {per}{left_out}")
    collectives = [f"{mode} {r.collective.describe()}" for mode, r in reports.items() if r.collective]
    if collectives:
        print("\n" + "\n".join(collectives))
    xronos_choice = reports["xronos"].layout_choice if "xronos" in reports else None
    if xronos_choice is not None:
        print(f"\nxronos layout (its median round): {xronos_choice.describe()}")
        chosen = [r.layout_choice.chosen.describe() for r in result.round_reports.get("xronos", []) if r.layout_choice]
        if len(set(chosen)) > 1:  # the rounds chose differently
            print("xronos layouts by round: " + "; ".join(chosen))
    xronos_rounds = result.round_reports.get("xronos") or ([reports["xronos"]] if "xronos" in reports else [])
    heads = [r.head_start for r in xronos_rounds]
    if any(heads):
        print(
            "xronos head start by round: "
            + "; ".join(f"{k + 1}: {head_start_text(h)}" for k, h in enumerate(heads) if h)
        )
    if "xronos" in reports and reports["xronos"].replans:
        print("\nxronos (its median round), rank order:\n" + "\n".join(replan_lines(reports["xronos"])))
    if "xronos" in reports and "tp" in reports and reports["xronos"].idle_ratio > 0:
        x, t = reports["xronos"], reports["tp"]
        print("\n" + idle_summary(x.idle_ratio, t.idle_ratio, x.predicted_idle_ratio, result.round_idle))
    pps = {m: r for m, r in reports.items() if r.mode == "pp"}
    if "xronos" in reports and pps:
        best = min(pps, key=lambda m: pps[m].mean_step_seconds)
        print(f"\nxronos / fastest pp ({best}): {_ratio_text(rounds, 'xronos', best)}")


def write_chart(result: BenchResult, path: str) -> None:
    """Two panels: mean step time per mode; per-device compute/comm/idle seconds per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = result.reports
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    modes = list(reports)
    left.bar(modes, [reports[m].mean_step_seconds for m in modes], color="#4c72b0")
    left.set_ylabel("seconds per step")
    left.set_title("step time by mode")
    labels, compute, comm, idle = [], [], [], []
    for m in modes:
        r = reports[m]
        for n in r.nodes if m != HF_TP else []:  # its step is not broken down
            labels.append(f"{m}\n{n.speed:g}")
            compute.append(n.compute_seconds / r.measured_steps)
            comm.append(n.comm_seconds / r.measured_steps)
            idle.append(n.idle_seconds / r.measured_steps)
    x = range(len(labels))
    right.bar(x, compute, label="compute", color="#55a868")
    right.bar(x, comm, bottom=compute, label="communication (incl. waiting)", color="#c44e52")
    right.plot([], [])
    right.scatter(x, idle, marker="_", s=300, color="black", label="idle (slowest compute - own)", zorder=3)
    right.set_xticks(list(x), labels, fontsize=8)
    right.set_ylabel("seconds per step")
    right.set_title("where each device's time goes (mode / device speed)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(result: BenchResult, path: str) -> None:
    Path(path).write_text(json.dumps(result.model_dump(), indent=2))
