"""Terminal tables for run reports: one run, or several modes side by side."""

from __future__ import annotations

from xronos.contract.report import HeadStart, NodeReport, ReplanCheck, RunReport, describe_layout, drifted
from xronos.contract.splits import kv_label


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def node_seconds(node: NodeReport, measured_steps: int) -> str:
    """'[speed] compute/comm/idle': one device's seconds per measured step, as the benches print them."""
    return (
        f"[{node.speed:g}] {node.compute_seconds / measured_steps:.2f}/{node.comm_seconds / measured_steps:.2f}/"
        f"{node.idle_seconds / measured_steps:.2f}"
    )


def print_report(report: RunReport) -> None:
    print(
        f"\nmode {report.mode}: {report.world_size} worker(s), {describe_layout(report.split, report.stages)}\n"
        f"final loss {report.losses[-1]:.4f}, mean step {report.mean_step_seconds:.3f} s "
        f"over {report.measured_steps} measured steps, idle ratio {report.idle_ratio:.1%}"
    )
    named = any(n.name for n in report.nodes)
    print(
        f"{'node':<12} " * named
        + f"{'rank':>4} {'speed':>5} {'kv':>6} {'mlp':>6} {'vocab':>6} {'compute s':>9} {'comm s':>7} {'idle s':>7} {'idle':>6} {'params MiB':>10} {'peak RSS MiB':>12}"
    )
    for n in report.nodes:
        speed = "-" if n.speed is None else f"{n.speed:g}"
        print(
            f"{n.name or '-':<12} "
            * named
            + f"{n.rank:>4} {speed:>5} {kv_label(n.kv_groups, n.kv_rows):>6} {n.mlp_columns:>6} {n.vocab_rows:>6} {n.compute_seconds:>9.2f} "
            f"{n.comm_seconds:>7.2f} {n.idle_seconds:>7.2f} {n.idle_ratio:>6.1%} {_mib(n.param_bytes):>10} {_mib(n.peak_rss_bytes):>12}"
        )
    if report.collective is not None:
        print(report.collective.describe())
    if report.head_start is not None:
        print(f"head start, while the others profiled: {head_start_text(report.head_start)}")
    if report.layout_choice is not None:
        print(f"layout: {report.layout_choice.describe()}")
    for e in report.excluded:
        speed = "-" if e.speed is None else f"{e.speed:g}"
        print(f"left out: {f'node {e.name}' if e.name else f'device {e.device}'} (speed {speed}): {e.reason}")
    for line in replan_lines(report):
        print(line)


def head_start_text(head: HeadStart) -> str:
    """What the head start trained, and how it ended: handed over (its checkpoint written in how long), or
    trained to the end."""
    trained = f"device {head.device} trained {head.steps} step(s) alone"
    if head.given_up:
        return f"{trained}, then gave them up: the others had profiled before it had a steady step to be priced by"
    if head.checkpoint is not None:
        return f"{trained}, then handed over ({head.handoff_seconds or 0:.2f} s to write its checkpoint)"
    return f"{trained}, and went on alone to the end" if head.finished else trained


def replan_lines(report: RunReport) -> list[str]:
    """One line per re-plan check: the devices whose compute drifted from the prediction beyond
    DRIFT_THRESHOLD (a device slowed down mid-job re-plans so), measured (with its attention + MLP +
    vocabulary segments) against predicted compute per rank, and the outcome."""
    names = {n.rank: n.name or f"device {n.device}" for n in report.nodes}

    def drift(c: ReplanCheck) -> str:
        far = [(names.get(rank, f"rank {rank}"), x) for rank, x in enumerate(c.drift()) if drifted(x)]
        return "".join(f"{name} drifted x{x:.2f}; " for name, x in far)

    def seconds(values: list[float]) -> str:
        return "/".join(f"{v:.2f}" for v in values)

    def parts(c) -> str:
        segments = c.measured_segment_seconds
        return f" ({'/'.join('+'.join(f'{x:.2f}' for x in rank) for rank in segments)})" if segments else ""

    def outcome(c) -> str:
        notes = (
            ([f"best {c.predicted_gain:.1%} shorter"] if c.predicted_gain is not None else [])
            + ([f"{c.reshard_seconds:.1f} s"] if c.reshard_seconds is not None else [])
            + ([f"step predicted {c.predicted_step_seconds:.2f} s"] if c.predicted_step_seconds else [])
        )
        return f" ({', '.join(notes)})" if notes else ""

    return [
        f"re-plan after step {c.after_step}: {drift(c)}"
        f"compute per step measured {seconds(c.measured_compute_seconds)}{parts(c)}, "
        f"predicted {seconds(c.predicted_compute_seconds)} -> "
        + (f"re-sharded to {c.new_split.describe()}" if c.new_split else "kept")
        + outcome(c)
        for c in report.replans
    ]


def print_side_by_side(reports: list[RunReport], baseline: str = "tp") -> None:
    """Step time, idle ratio and final loss per mode, with each mode's ratio to `baseline`."""
    base = next((r for r in reports if r.mode == baseline), None)
    print(
        f"\n{'mode':<8} {'split':<44} {'reduce':>6} {'step s':>7} {'vs ' + baseline:>7} {'idle':>6} {'final loss':>10}"
    )
    for r in reports:
        ratio = f"{r.mean_step_seconds / base.mean_step_seconds:.2f}" if base else "-"
        reduce = r.collective.label() if r.collective else "-"
        print(
            f"{r.mode:<8} {describe_layout(r.split, r.stages)[:44]:<44} {reduce:>6} {r.mean_step_seconds:>7.3f} {ratio:>7} "
            f"{r.idle_ratio:>6.1%} {r.losses[-1]:>10.4f}"
        )


def print_plan(plan) -> None:
    """The partitioner's plan: who holds what, predicted seconds, and who sits out and why."""
    print(
        f"split {plan.split.describe()}"
        + (
            "  (*: weight gradients computed later: an MLP's, and vocab *N: the LM head's of N rows, in the wait"
            " for attention, an attention's in the MLP below)"
            if plan.split.weight_grads_later or plan.split.attention_weight_grads_later or plan.split.vocab_rows_later
            else ""
        )
    )
    print(
        f"predicted step {plan.predicted_step_seconds:.3f} s (collectives {plan.collective_seconds:.3f} s)"
        + ("" if plan.optimal else "; the best plan found within the solver's time cap, not proven optimal")
    )
    print(f"predicted idle {plan.predicted_idle_ratio:.1%} (mean over devices of idle / step)")
    print(
        f"{'device':<12} {'rank':>4} {'kv':>6} {'mlp':>6} {'vocab':>7} {'compute s':>9} {'idle s':>6} {'memory MiB':>10}  note"
    )
    for d in plan.devices:
        rank = "-" if d.rank is None else d.rank
        print(
            f"{d.device:<12} {rank:>4} {kv_label(d.kv_groups, d.kv_rows):>6} {d.mlp_columns:>6} {d.vocab_rows:>7} "
            f"{d.compute_seconds:>9.3f} {d.idle_seconds:>6.3f} {d.memory_bytes / 2**20:>10.0f}  {d.reason or ''}"
        )
