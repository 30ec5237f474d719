"""Removing what a killed process left behind: `xronos run`'s temporary directories and CPU quota groups.

A run or an agent removes its own files and groups when it ends, whether the job
succeeded or failed; one killed by SIGKILL (the OOM killer, a power cut) cannot.
The next start removes them, and only what no live process uses: another run on
the same machine may be in its first seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from edge_node.cpu_quota import remove_stale_cgroups

log = logging.getLogger(__name__)

RUN_DIR_PREFIX = "xronos-run-"
STALE_RUN_SECONDS = 600.0
"""A run directory younger than this may belong to a run still loading its data, before any worker starts."""

__all__ = ["remove_stale_cgroups", "remove_stale_run_dirs"]


def _command_lines() -> list[str]:
    """The command lines of every live process (a worker names its spec file in the run directory)."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return out


def remove_stale_run_dirs(root: str | os.PathLike | None = None, min_age: float = STALE_RUN_SECONDS) -> list[Path]:
    """Remove `xronos-run-*` directories in `root` (the temp dir) that no live process names, older than `min_age`."""
    root = Path(root or tempfile.gettempdir())
    now = time.time()
    candidates = []
    for path in root.glob(f"{RUN_DIR_PREFIX}*"):
        try:
            if path.is_dir() and not path.is_symlink() and now - path.stat().st_mtime >= min_age:
                candidates.append(path)
        except OSError:
            continue
    if not candidates:
        return []
    in_use = _command_lines()
    removed = [p for p in candidates if not any(str(p) in line for line in in_use)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        log.info("removed %d leftover run director%s", len(removed), "y" if len(removed) == 1 else "ies")
    return removed
