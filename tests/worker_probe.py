"""A stand-in worker entry point (`main(argv)`, as `edge_node.worker`'s) for tests/test_worker_process.py:
it writes what it sees of its process to ARGV[0] + '.seen', a line to stderr, and exits 3, or, where
the file ARGV[0] says 'sleep', sleeps until it is killed."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    seen = {
        "probe": os.environ.get("XRONOS_PROBE"),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "argv": sys.argv,
    }
    Path(argv[0] + ".seen").write_text(json.dumps(seen))
    print("probe: started", file=sys.stderr, flush=True)
    spec = Path(argv[0])
    if spec.is_file() and spec.read_text() == "sleep":
        while True:
            time.sleep(1)
    print("ValueError: the probe's last words", file=sys.stderr)
    return 3
