"""Entry point of one worker process: `python -m edge_node.worker SPEC.json`.

Started by the local launcher (`xronos run`); the spec file says which rank
this is and what to train. Writes its measurements to the spec's result file.
A user error exits 2 with one line on stderr; anything else is a traceback
(the launcher shows its last line and stops the other workers).
"""

from __future__ import annotations

import sys
from pathlib import Path

from edge_node.trainer import Trainer, WorkerSpec
from xronos.errors import XronosError


def main(argv: list[str]) -> int:
    spec = WorkerSpec.model_validate_json(Path(argv[0]).read_text())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        trainer = Trainer(spec)
        trainer.train()
        Path(spec.result_file).write_text(trainer.result().model_dump_json())
        trainer.close()
    except XronosError as err:
        print(f"xronos: error: rank {spec.rank}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
