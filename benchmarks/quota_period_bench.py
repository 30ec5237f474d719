"""Benchmark: what a CPU quota's period does to a device that waits between calls.

Times one training step of SmolLM2's MLP at three column blocks (batch 4 x 128,
one thread) in a child process under a cgroup v1 quota of `--speed` cores, once
per period: back to back, and after sleeps of 5, 20 and 50 ms (as a device waits
in a collective). A device that is merely slower takes the same time either way;
a quota hands a waiting process its period's allowance at full speed. Medians of
15 calls. Not a test: numbers, to be quoted. Needs root and the cgroup v1 cpu
controller.

    python benchmarks/quota_period_bench.py --speed 0.25 --periods-us 10000,4000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from edge_node.cpu_quota import CGROUP_V1_CPU, cgroup_quota_available
from edge_node.toy_model import SMOL_SHAPES, make_model

CHILD = """
import statistics, sys, time, torch
from edge_node.cpu_quota import join_quota
from edge_node.model_io import load_config
from edge_node.profiler import training_step, model_variant
from xronos.contract.splits import ModelDims
torch.set_num_threads(1)
config = load_config(sys.argv[1]); dims = ModelDims.from_config(config)
if sys.argv[2] != "none":
    join_quota(sys.argv[2])
h = torch.randn(4, 128, dims.hidden_size, requires_grad=True)
mlp = model_variant(config, dims, 1, 1, 3 * dims.mlp_block, 8).model.layers[0].mlp
step = training_step(lambda: mlp(h), list(mlp.parameters()))
for _ in range(3):
    step()
for pause in (0, 0.005, 0.02, 0.05):
    times = []
    for _ in range(15):
        time.sleep(pause)
        start = time.perf_counter(); step(); times.append(time.perf_counter() - start)
    print(f"  after {pause * 1e3:>2.0f} ms wait: {statistics.median(times) * 1e3:6.1f} ms per call", flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speed", type=float, default=0.25)
    parser.add_argument("--periods-us", default="10000,4000")
    args = parser.parse_args()
    if not cgroup_quota_available():
        sys.exit("quota_period_bench: error: needs a writable cgroup v1 cpu controller (root)")
    with tempfile.TemporaryDirectory(prefix="xronos-period-") as tmp:
        model = make_model(Path(tmp) / "model", layers=1, **SMOL_SHAPES)
        print("full core:", flush=True)
        subprocess.run([sys.executable, "-c", CHILD, str(model), "none"], check=True)
        for period in (int(p) for p in args.periods_us.split(",")):
            group = CGROUP_V1_CPU / f"xronos-period-bench-{os.getpid()}"
            group.mkdir()
            try:
                (group / "cpu.cfs_quota_us").write_text("-1")
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(round(args.speed * period)))
                print(f"speed {args.speed}, period {period / 1000:g} ms:", flush=True)
                subprocess.run([sys.executable, "-c", CHILD, str(model), str(group / "cgroup.procs")], check=True)
            finally:
                group.rmdir()


if __name__ == "__main__":
    main()
