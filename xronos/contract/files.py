"""Writing a file so that no reader ever sees half of it: one helper for every small file Xronos hands over.

Other processes read these files while they are written (a launcher polls for a
worker's profile, Prometheus re-reads its file_sd targets, a restarted controller
reads its state): the text goes to a temporary name in the same directory, is
flushed to disk, and is renamed over the target in one step.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomically(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w", encoding=encoding) as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
