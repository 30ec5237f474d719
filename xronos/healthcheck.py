"""The container image's HEALTHCHECK: `python -m xronos.healthcheck`.

Healthy means the process's Prometheus endpoint answers `/metrics`: a node
or controller that is wedged stops answering, one that merely waits for the
broker still answers (it reconnects by itself, so a broker outage must not
get every container restarted). The port is read from the command line of
the container's first process (`xronos node ... --metrics-port 9101`, behind
docker-init when compose says `init: true`), so it is configured once, where
the process takes it. A process without a metrics port (a one-shot
`xronos train`) is healthy while it runs.
"""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

FIRST_PROCESS = Path("/proc/1/cmdline")


def metrics_port(argv: list[str]) -> int | None:
    """The value of `--metrics-port N` / `--metrics-port=N` in `argv` (None: not given, or not a number)."""
    for i, arg in enumerate(argv):
        value = (
            argv[i + 1]
            if arg == "--metrics-port" and i + 1 < len(argv)
            else (arg.partition("=")[2] if arg.startswith("--metrics-port=") else None)
        )
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def check(cmdline: Path = FIRST_PROCESS, host: str = "127.0.0.1", timeout: float = 4.0) -> str | None:
    """None when healthy, else why not (one line)."""
    argv = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0") if a]
    port = metrics_port(argv)
    if port is None or port == 0:  # no endpoint to ask (0 = a free port the process alone knows)
        return None
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as answer:
            answer.read(1)
    except OSError as err:
        return f"metrics endpoint {host}:{port} does not answer: {getattr(err, 'reason', None) or err}"
    return None


def main() -> int:
    problem = check()
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
