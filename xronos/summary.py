"""Terminal tables for run reports: one run, or several modes side by side."""

from __future__ import annotations

from xronos.report import RunReport


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f}"


def print_report(report: RunReport) -> None:
    print(
        f"\nmode {report.mode}: {report.world_size} worker(s), split {report.split.describe()}\n"
        f"final loss {report.losses[-1]:.4f}, mean step {report.mean_step_seconds:.3f} s "
        f"over {report.measured_steps} measured steps, idle ratio {report.idle_ratio:.1%}"
    )
    print(f"{'rank':>4} {'speed':>5} {'kv':>3} {'mlp':>6} {'vocab':>6} {'compute s':>9} {'comm s':>7} {'idle s':>7} {'idle':>6} {'params MiB':>10} {'peak RSS MiB':>12}")
    for n in report.nodes:
        speed = "-" if n.speed is None else f"{n.speed:g}"
        print(
            f"{n.rank:>4} {speed:>5} {n.kv_groups:>3} {n.mlp_columns:>6} {n.vocab_rows:>6} {n.compute_seconds:>9.2f} "
            f"{n.comm_seconds:>7.2f} {n.idle_seconds:>7.2f} {n.idle_ratio:>6.1%} {_mib(n.param_bytes):>10} {_mib(n.peak_rss_bytes):>12}"
        )


def print_side_by_side(reports: list[RunReport], baseline: str = "tp") -> None:
    """Step time, idle ratio and final loss per mode, with each mode's ratio to `baseline`."""
    base = next((r for r in reports if r.mode == baseline), None)
    print(f"\n{'mode':<8} {'split':<44} {'step s':>7} {'vs ' + baseline:>7} {'idle':>6} {'final loss':>10}")
    for r in reports:
        ratio = f"{r.mean_step_seconds / base.mean_step_seconds:.2f}" if base else "-"
        print(f"{r.mode:<8} {r.split.describe()[:44]:<44} {r.mean_step_seconds:>7.3f} {ratio:>7} {r.idle_ratio:>6.1%} {r.losses[-1]:>10.4f}")
