"""A 5,000-step job over MQTT (issue 30): its nodes' results, ~630 KiB each, reach the controller in parts
and the report is complete (every aggregate from every step of both ranks).

Runs the suite's check (`tests/test_resilience_jobs.py`, 2,200 steps there) at 5,000 steps with real
Mosquitto, `xronos controller`, two `xronos node`s and `xronos train --wait`:

    python benchmarks/long_job.py [STEPS]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    steps = sys.argv[1] if len(sys.argv) > 1 else "5000"
    return subprocess.call(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--durations=3",
            "tests/test_resilience_jobs.py",
            "-k",
            "exceed_one_message",
        ],
        cwd=ROOT,
        env={**os.environ, "XRONOS_LONG_JOB_STEPS": steps},
    )


if __name__ == "__main__":
    sys.exit(main())
