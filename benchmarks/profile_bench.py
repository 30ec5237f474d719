"""Benchmark: how long the on-device profile takes, and what it measures, under CPU quotas.

Profiles SmolLM2's layer shapes (batch 4 x 128 tokens, one thread) afresh
(no cache) in a child process under each quota in turn, as a worker would
be, and prints the profile's own wall time and its unit costs. Not a test:
numbers, to be quoted.

    python benchmarks/profile_bench.py --speeds 1,0.43,0.25
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from edge_node.cpu_quota import make_quota
from edge_node.toy_model import SMOL_SHAPES, make_model
from xronos.contract.profiles import COMPUTE_FIELDS

CHILD = """
import sys
from edge_node.model_io import load_config
from edge_node.profiler import profile_device
print(profile_device(load_config(sys.argv[1]), 4, 128, 1, "bench", use_cache=False).model_dump_json())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="1,0.43,0.25")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xronos-profile-") as tmp:
        model = make_model(Path(tmp) / "model", layers=1, **SMOL_SHAPES)
        for speed in (float(s) for s in args.speeds.split(",")):
            quota = make_quota(f"xronos-profile-bench-{os.getpid()}", speed)
            child = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(model)],
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
            )
            quota.add(child.pid)
            out, _ = child.communicate()
            quota.close()
            p = json.loads(out)
            units = {
                k.removesuffix("_seconds"): round(p[k] * 1e3, 2) for k in (*COMPUTE_FIELDS, "allreduce_seconds_per_mib")
            }
            parts = {
                k: round(p[k], 2)
                for k in (
                    "mlp_weight_grad_fraction",
                    "attention_weight_grad_fraction",
                    "vocab_weight_grad_fraction",
                    "attention_backward_fraction",
                )
            }
            print(f"speed {speed:g}: profile took {p['profile_seconds']:.2f} s; ms {units}; {parts}", flush=True)


if __name__ == "__main__":
    main()
