"""Benchmark: one all-reduce by gloo's ring and through a hub, on ranks under CPU quotas.

Starts one process per `--speeds` entry, each under a cgroup v1 quota of that many
cores (4 ms period, as `xronos run` sets them; packed onto this machine's cores as the
launcher packs workers), and times all-reduces of an activation of SmolLM2-135M's
width (`--rows` x 576 floats; 4 x 128 rows = 1.125 MiB) both ways, alternately, through
`edge_node.tp.comm` (`time_collectives`, what a job's `collective: auto` runs before its
first step, here with more trials; the hub over its own sockets, as a job's, and then through gloo's
messages for comparison). Prints each algorithm's time as the ranks agree on it (the slowest rank's
median). Then, through the hub, the all-reduces of a layout where only
some ranks hold a share (`TPContext.holders`): rank 0 alone (a broadcast, as kv 3/0/0's attention)
and all but the last rank (as kv 2/1/0's). Not a test: numbers, to be quoted. Needs root
and the cgroup v1 cpu controller.

    python benchmarks/collective_bench.py --speeds 0.65,0.52,0.43
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid

from edge_node.cpu_quota import CgroupQuota, cgroup_quota_available, pack_cores
from edge_node.worker_process import free_port

CHILD = """
import statistics, sys, time, torch, torch.distributed as dist
from edge_node.cpu_quota import join_quota
from edge_node.tp.comm import all_reduce, open_star, time_collectives
from edge_node.tp.context import TPContext
from edge_node.worker import exit_now
rank, world, port, numel, hub, trials = (int(a) for a in sys.argv[1:7])
torch.set_num_threads(1)
join_quota(sys.argv[7])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
star = open_star(hub, "127.0.0.1", 60.0)
assert star is not None, "the hub's sockets could not be opened"
time_collectives(numel, hub, star, trials=3)  # warm-up
ring, through_hub = time_collectives(numel, hub, star, trials=trials)
_, through_gloo = time_collectives(numel, hub, trials=trials)
if rank == 0:
    print(f"  ring {ring * 1e3:6.2f} ms   hub (rank {hub}) {through_hub * 1e3:6.2f} ms   hub / ring {through_hub / ring:.2f}"
          f"   hub through gloo's messages {through_gloo * 1e3:6.2f} ms", flush=True)
layouts = {"rank 0 alone holds a share (broadcast)": (0,), "all but the last rank hold one": tuple(range(world - 1))}
tp = TPContext(hub=hub, holders=layouts, star=star)
tensor, seconds = torch.zeros(numel), {name: [] for name in layouts}
for _ in range(trials):
    for name in layouts:
        start = time.perf_counter()
        all_reduce(tensor, tp, closes=name)
        seconds[name].append(time.perf_counter() - start)
agreed = torch.tensor([statistics.median(s) for s in seconds.values()])
dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
if rank == 0:
    for name, s in zip(layouts, agreed.tolist()):
        print(f"  hub, {name}: {s * 1e3:6.2f} ms   / hub with all {s / through_hub:.2f}", flush=True)
star.close()
dist.barrier()  # every rank done with the store before rank 0's goes
dist.destroy_process_group()
exit_now(0)  # as a job's workers exit: an interpreter's teardown once ended a rank in std::terminate
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="0.65,0.52,0.43", help="cores per rank; rank 0 first")
    parser.add_argument("--rows", type=int, default=512, help="batch x sequence rows of the activation")
    parser.add_argument("--width", type=int, default=576, help="hidden size")
    parser.add_argument("--hub", type=int, default=0)
    parser.add_argument("--trials", type=int, default=60)
    args = parser.parse_args()
    if not cgroup_quota_available():
        sys.exit("collective_bench: error: needs a writable cgroup v1 cpu controller (root)")
    speeds = [float(s) for s in args.speeds.split(",")]
    cpus = pack_cores(speeds, len(os.sched_getaffinity(0)))
    port, run = free_port(), uuid.uuid4().hex[:8]
    print(
        f"speeds {speeds}, all-reduce of {args.rows} x {args.width} floats "
        f"({args.rows * args.width * 4 / 2**20:.3f} MiB), slowest rank's median of {args.trials}:",
        flush=True,
    )
    quotas, procs = [], []
    try:
        for rank, speed in enumerate(speeds):
            quotas.append(CgroupQuota(f"xronos-allreduce-{run}-{rank}", speed))
            command = [
                sys.executable,
                "-c",
                CHILD,
                str(rank),
                str(len(speeds)),
                str(port),
                str(args.rows * args.width),
                str(args.hub),
                str(args.trials),
                quotas[-1].procs_file,
            ]
            pin = (lambda c=cpus[rank]: os.sched_setaffinity(0, c)) if cpus else None
            procs.append(subprocess.Popen(command, preexec_fn=pin))
        if any(p.wait() for p in procs):
            sys.exit("collective_bench: error: a rank failed (see above)")
    finally:
        for p in procs:
            p.kill()
        for quota in quotas:
            quota.close()


if __name__ == "__main__":
    main()
