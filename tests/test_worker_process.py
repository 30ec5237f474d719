"""Workers forked from the worker server (edge_node.worker_process): what a worker started by exec
had, it still has: the environment of the process that starts it (not the server's), its
command line naming its spec, its cores, its stderr in its log, its exit code, and its end with
the process that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from edge_node.worker_process import WorkerProcess, warm_worker_server

REPO = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_forked_worker_sees_its_starters_environment_names_its_spec_and_reports_its_exit(tmp_path, monkeypatch):
    warm_worker_server()
    monkeypatch.setenv("XRONOS_PROBE", "set after the server started")
    spec = tmp_path / "spec-0.json"
    worker = WorkerProcess(
        0, spec, tmp_path / "device-0.log", echo=False, threads=3, cpus={0}, module="tests.worker_probe"
    )
    assert worker.proc.wait(timeout=60) == 3
    seen = json.loads(Path(str(spec) + ".seen").read_text())
    assert seen["probe"] == "set after the server started"
    assert seen["threads"] == "3"
    assert seen["cmdline"].endswith(f"-m tests.worker_probe {spec}")
    assert seen["cpus"] == [0]
    assert seen["argv"] == ["tests.worker_probe", str(spec)]
    assert seen["not_preloaded"] == []  # the server's imports, not the worker's
    assert "probe: started" in (tmp_path / "device-0.log").read_text()
    assert worker.cause() == "worker for device 0 exited with code 3: ValueError: the probe's last words"


def test_an_exception_out_of_main_is_in_the_log_and_exits_1(tmp_path):
    spec = tmp_path / "spec-2.json"
    spec.write_text("raise")
    worker = WorkerProcess(2, spec, tmp_path / "device-2.log", echo=False, threads=1, module="tests.worker_probe")
    assert worker.proc.wait(timeout=60) == 1
    assert worker.cause() == "worker for device 2 exited with code 1: ValueError: the probe's last words"
    assert "Traceback" in (tmp_path / "device-2.log").read_text()


def _wait_seen(spec: Path) -> None:
    deadline = time.monotonic() + 60
    while not Path(str(spec) + ".seen").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_worker_killed_by_a_signal_says_which(tmp_path):
    spec = tmp_path / "spec-1.json"
    spec.write_text("sleep")
    worker = WorkerProcess(1, spec, tmp_path / "device-1.log", echo=False, threads=1, module="tests.worker_probe")
    _wait_seen(spec)
    worker.proc.kill()
    assert worker.proc.wait(timeout=30) == -signal.SIGKILL
    assert worker.cause().startswith("worker for device 1 was killed by SIGKILL")


STARTER = """
import sys, time
from pathlib import Path
from edge_node.worker_process import WorkerProcess
w = WorkerProcess(0, Path(sys.argv[1]), Path(sys.argv[2]), echo=False, threads=1, module="tests.worker_probe")
print(w.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_dies_with_the_process_that_started_it(tmp_path):
    """SIGKILL the starter: its worker server sees it gone and exits, and the worker with it (PR_SET_PDEATHSIG)."""
    spec = tmp_path / "spec-0.json"
    spec.write_text("sleep")
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(spec), str(tmp_path / "device-0.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert starter.stdout is not None
    pid = int(starter.stdout.readline())
    try:
        _wait_seen(spec)
        assert _alive(pid)
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the worker outlived the process that started it"
    finally:
        starter.kill()
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
