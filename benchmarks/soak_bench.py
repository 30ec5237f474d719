"""Benchmark: a long-lived controller stays bounded: 10,000 rejected commands, then 200 completed tiny jobs.

Mosquitto (open), `xronos controller --state-dir` and two nodes as processes. First a
flood of train commands the controller must reject (each names a node that does not
exist, with a new job id), then tiny jobs (1 step, one node each, two in flight),
each waited for to complete. At intervals it prints the controller's resident
memory and open files, the state files in `--state-dir`, the retained job statuses a
fresh subscriber receives, and the nodes' job directories. With the windows of
`controller/service.py` (`--keep-jobs`, KEPT_REJECTED) and `edge_node/agent.py`
(KEPT_JOB_DIRS) all of them level off.

Not a test: numbers, to be quoted. Needs `mosquitto` on the PATH.

    python benchmarks/soak_bench.py --rejected 10000 --jobs 200
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import paho.mqtt.client as paho  # noqa: E402
from live_cluster import wait_for, xronos_process  # noqa: E402
from wire_fuzz import metrics, open_files, resident_bytes  # noqa: E402

from edge_node.toy_model import make_data, make_model  # noqa: E402
from edge_node.worker_process import free_port, stop_processes  # noqa: E402
from xronos.contract import wire  # noqa: E402
from xronos.contract.job import JobOptions  # noqa: E402
from xronos.mosquitto import Mosquitto  # noqa: E402

NODES = ("n0", "n1")


def retained_statuses(port: int) -> int:
    """Retained job statuses a fresh subscriber receives."""
    seen = set()
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"count-{time.monotonic_ns()}")
    client.on_message = lambda c, u, m: seen.add(m.topic) if m.retain and m.payload else None
    client.connect("127.0.0.1", port)
    client.subscribe(wire.JOB_STATUS.subscription(), qos=1)
    client.loop_start()
    last, quiet = -1, 0
    while quiet < 3:  # until nothing new for 0.6 s
        time.sleep(0.2)
        quiet = quiet + 1 if len(seen) == last else 0
        last = len(seen)
    client.loop_stop()
    client.disconnect()
    return len(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rejected", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--every", type=int, default=1000, help="print after this many rejected commands")
    parser.add_argument("--job-every", type=int, default=20, help="print after this many jobs")
    parser.add_argument("--minutes", type=float, default=15.0, help="stop the jobs phase after this long")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xronos-soak-") as tmp, Mosquitto(users=None) as broker:
        root = Path(tmp)
        model = make_model(root / "model", hidden=48, layers=2, heads=6, kv_heads=3, intermediate=160, vocab=320)
        data = make_data(root / "rows.jsonl", rows=40, seq_len=20, vocab=320, seed=3)
        port = free_port()
        state = root / "state"
        common = dict(password="-", url=broker.url)
        procs = [
            xronos_process(
                "controller",
                "--metrics-port",
                str(port),
                "--state-dir",
                str(state),
                user="controller",
                log=root / "controller.log",
                **common,
            )
        ]
        for node in NODES:
            procs.append(
                xronos_process(
                    "node",
                    "--node-id",
                    node,
                    "--workdir",
                    str(root / node),
                    user=node,
                    log=root / f"{node}.log",
                    **common,
                )
            )
        controller = procs[0].pid
        try:
            wait_for(lambda: _get(port, "xronos_nodes_online") == len(NODES), 120, "the nodes online", poll=0.5)
            done: dict[str, str] = {}
            client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="soak")
            client.max_queued_messages_set(0)

            def on_status(c, u, m):
                if m.payload:
                    status = wire.JOB_STATUS.decode(m.payload)
                    if status.finished:
                        done[status.job_id] = status.state

            client.on_message = on_status
            client.connect("127.0.0.1", broker.port)
            client.subscribe(wire.JOB_STATUS.subscription(), qos=1)
            client.loop_start()

            def report(label: str) -> None:
                files = len(list((state / "jobs").glob("*.json"))) if (state / "jobs").is_dir() else 0
                dirs = sum(len(list((root / n / "jobs").glob("*"))) for n in NODES if (root / n / "jobs").is_dir())
                print(
                    f"{label:<22} controller {resident_bytes(controller) / 2**20:6.1f} MiB "
                    f"{open_files(controller):3d} fds | state files {files:4d} | "
                    f"retained job statuses {retained_statuses(broker.port):4d} | node job dirs {dirs:3d}",
                    flush=True,
                )

            report("start")
            job = JobOptions(model="/nowhere", data="/nowhere", output="/nowhere")
            began = time.monotonic()
            for i in range(1, args.rejected + 1):
                command = wire.TrainCommand(job_id=f"junk-{i}", job=job, nodes=["ghost"])
                client.publish(wire.TRAIN.name(), wire.TRAIN.encode(command), qos=1).wait_for_publish(10)
                if i % args.every == 0:
                    wait_for(lambda j=f"junk-{i}": j in done, 60, "the controller to reject the last one")
                    report(f"{i:,} rejected")
            print(f"{args.rejected:,} rejected commands in {time.monotonic() - began:.1f} s", flush=True)

            options = JobOptions(
                model=str(model),
                data=str(data),
                output=str(root / "out"),
                mode="single",
                steps=1,
                batch_size=4,
                seq_len=16,
            )
            began, completed, failed = time.monotonic(), 0, 0
            for first in range(1, args.jobs + 1, len(NODES)):  # one job per node, all nodes at once
                if time.monotonic() - began > args.minutes * 60:
                    print(f"stopped after {args.minutes:g} minutes", flush=True)
                    break
                batch = [(f"tiny-{first + k}", node) for k, node in enumerate(NODES) if first + k <= args.jobs]
                for job_id, node in batch:  # an output per node: two jobs must not write one directory
                    job = options.model_copy(update={"output": str(root / f"out-{node}")})
                    command = wire.TrainCommand(job_id=job_id, job=job, nodes=[node])
                    client.publish(wire.TRAIN.name(), wire.TRAIN.encode(command), qos=1).wait_for_publish(10)
                for job_id, _ in batch:
                    wait_for(lambda j=job_id: j in done, 300, f"job {job_id}", poll=0.05)
                    completed += done[job_id] == "completed"
                    failed += done[job_id] != "completed"
                if any(int(j.split("-")[1]) % args.job_every == 0 for j, _ in batch):
                    report(f"{completed + failed} jobs ({completed} ok)")
            print(
                f"{completed} jobs completed, {failed} not, in {time.monotonic() - began:.0f} s "
                f"({(time.monotonic() - began) / max(1, completed + failed):.1f} s a job)",
                flush=True,
            )
            report("end")
            client.loop_stop()
        finally:
            stop_processes(procs, grace=15)


def _get(port: int, key: str) -> float | None:
    try:
        return metrics(port).get(key)
    except OSError:
        return None


if __name__ == "__main__":
    main()
