"""A stand-in worker entry point (`main(argv)`, as `edge_node.worker`'s) for tests/test_worker_process.py:
it writes what it sees of its process to ARGV[0] + '.seen', a line to stderr, and exits 3; where the
file ARGV[0] says 'sleep', it sleeps until it is killed, and where it says 'raise', raises."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from edge_node.worker_process import PRELOAD


def main(argv: list[str]) -> int:
    seen = {
        "probe": os.environ.get("XRONOS_PROBE"),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "cmdline": Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode().strip(),
        "cpus": sorted(os.sched_getaffinity(0)),
        "argv": sys.argv,
        "not_preloaded": [name for name in PRELOAD if name not in sys.modules],
    }
    Path(argv[0] + ".seen").write_text(json.dumps(seen))
    print("probe: started", file=sys.stderr, flush=True)
    spec = Path(argv[0])
    said = spec.read_text() if spec.is_file() else ""
    if said == "sleep":
        while True:
            time.sleep(1)
    if said == "raise":
        raise ValueError("the probe's last words")
    print("ValueError: the probe's last words", file=sys.stderr)
    return 3
