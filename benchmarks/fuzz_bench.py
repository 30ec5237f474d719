"""Benchmark: 10,000 generated hostile messages over every topic against a live controller and node.

The same machinery as `tests/test_hostile.py` (`tests/wire_fuzz.py`), at scale: an
open Mosquitto (no ACLs: anyone writes any topic), `xronos controller` and `xronos
node n0` as processes, and a hypothesis-driven fuzzer publishing valid, broken,
garbage, empty and oversized payloads, retained or not, on every topic family.
Prints what was sent, what the contract says must be counted and what each process
counted, both processes' memory and open files before and after, tracebacks in
their logs, and a training job run on the node afterwards.

Not a test: numbers, to be quoted. Needs `mosquitto` on the PATH.

    python benchmarks/fuzz_bench.py --messages 10000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from live_cluster import train_by_command, wait_for  # noqa: E402
from wire_fuzz import (  # noqa: E402
    NODE,
    Expected,
    FuzzCluster,
    hostile_messages,
    invalid,
    metrics,
    open_files,
    resident_bytes,
)

from edge_node.toy_model import make_data, make_model  # noqa: E402
from xronos.contract import wire  # noqa: E402


def footprint(cluster: FuzzCluster) -> str:
    c, n = cluster.controller.pid, cluster.node.pid
    return (
        f"controller {resident_bytes(c) / 2**20:.1f} MiB, {open_files(c)} fds; "
        f"node {resident_bytes(n) / 2**20:.1f} MiB, {open_files(n)} fds"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xronos-fuzz-") as tmp:
        root = Path(tmp)
        model = make_model(root / "model", hidden=48, layers=2, heads=6, kv_heads=3, intermediate=160, vocab=320)
        data = make_data(root / "rows.jsonl", rows=40, seq_len=20, vocab=320, seed=3)
        with FuzzCluster(root) as cluster:
            wait_for(cluster.idle, 60, "the cluster to be idle")
            print(f"before: {footprint(cluster)}")
            start_c, start_n = metrics(cluster.ports["controller"]), metrics(cluster.ports[NODE])
            expected = Expected()

            @settings(
                max_examples=args.messages,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(message=hostile_messages())
            def publish(message):
                name, payload, retain = message
                expected.add(name, payload)
                cluster.publish(name, payload, retain)

            began = time.monotonic()
            publish()
            end_c, end_n = cluster.settle(expected)
            seconds = time.monotonic() - began
            sent = sum(expected.sent.values())
            print(f"sent {sent:,} messages in {seconds:.1f} s ({sent / seconds:,.0f}/s), all handled")
            print(f"{'family':<22}{'sent':>8}{'must count':>12}{'controller counted':>20}")
            short = 0
            for topic in wire.TOPICS:
                family = topic.family
                counted = invalid(end_c, family) - invalid(start_c, family)
                short += counted < expected.controller[family]
                print(f"{family:<22}{expected.sent[family]:>8}{expected.controller[family]:>12}{counted:>20.0f}")
            node_counted = invalid(end_n, wire.ASSIGNMENT.family, NODE) - invalid(start_n, wire.ASSIGNMENT.family, NODE)
            print(f"node {NODE}: {expected.node} broken messages on its assignment topic, counted {node_counted:.0f}")
            print(f"families where the controller counted fewer than it must: {short}")
            print(f"processes alive: {cluster.alive()}")
            print(f"after:  {footprint(cluster)}")
            tracebacks = {name: (root / f"{name}.log").read_text().count("Traceback") for name in ("controller", NODE)}
            print(f"tracebacks in the logs (handlers that failed and were caught at the boundary): {tracebacks}")
            wait_for(cluster.idle, 120, "the fuzzed jobs to end")
            began = time.monotonic()
            result = train_by_command(
                cluster.broker.url,
                "-",
                model,
                data,
                root / "out",
                "after-fuzz",
                "--nodes",
                NODE,
                steps=3,
                seq_len=16,
                batch_size=4,
                log=root / "train.log",
            )
            outcome = "completed" if result.returncode == 0 else f"FAILED: {result.stderr.strip()[-300:]}"
            print(f"a 3-step job on {NODE} afterwards: {outcome} in {time.monotonic() - began:.1f} s")


if __name__ == "__main__":
    main()
