"""What a job's inputs must satisfy before any worker starts: shared by `xronos run` and the node agent.

A mistake found here is one line naming it (`XronosError`); found in a worker it
is a dead process, and found never it is a quietly different job. Two of the
latter are caught here: a data set with fewer rows than one batch (each step
would repeat rows, and the batch would not be what the user asked for), and
`--resume` from a checkpoint of another model than `--model` (the checkpoint's
weights would silently replace the model the user named).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from edge_node.checkpoint import resume_point
from edge_node.data import load_rows
from edge_node.model_io import load_config
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.splits import ModelDims


def check_rows(rows: torch.Tensor, job: JobOptions) -> None:
    """At least one batch of rows: fewer would repeat rows within a step."""
    if len(rows) < job.batch_size:
        raise XronosError(
            f"{job.data}: {len(rows)} rows of --seq-len {job.seq_len}, fewer than --batch-size {job.batch_size} "
            "(a step would use rows twice); give more data or a smaller --batch-size"
        )


def check_resume(job: JobOptions, dims: ModelDims) -> Path | None:
    """`--resume` continues from the newest usable checkpoint under `output`, or from `resume_step`'s when
    the job names one (`checkpoint.resume_point`): it must be there, beyond `--steps`' reach, and of the
    model named. Returns it (None: no --resume), so the workers start from the checkpoint checked here
    instead of reading every file's checksum again."""
    if not job.resume:
        return None
    found = resume_point(Path(job.output), job)
    if job.lora is not None:  # an adapter checkpoint: the base model is --model's, the factors must fit it
        from edge_node.lora_io import check_adapter_shapes
        from edge_node.model_io import full_param_shapes
        from edge_node.tp.lora import lora_shapes

        check_adapter_shapes(found, job.lora, lora_shapes(full_param_shapes(load_config(job.model)), job.lora))
        return found
    theirs = ModelDims.from_config(load_config(found))
    if theirs != dims:
        differ = [
            f"{name} {getattr(theirs, name)} (--model: {getattr(dims, name)})"
            for name in type(dims).model_fields
            if getattr(theirs, name) != getattr(dims, name)
        ]
        raise XronosError(
            f"--resume: the checkpoint {found} is of another model than --model {job.model}: "
            f"{', '.join(differ)}; resume with the model it was trained from, or give a new --output"
        )
    return found


def check_output(job: JobOptions) -> None:
    """`output` becomes a directory: a file there would fail the job only after its last step."""
    output = Path(job.output)
    if output.exists() and not output.is_dir():
        raise XronosError(f"--output {job.output!r} is a file, not a directory")


class JobInputs(NamedTuple):
    dims: ModelDims
    rows: torch.Tensor
    resume_from: Path | None
    """The checkpoint `--resume` continues from, verified against its manifest (None: no --resume)."""


def job_inputs(job: JobOptions) -> JobInputs:
    """The model's sizes, the data's rows and the checkpoint to resume from, checked against each other and
    against the job."""
    dims = ModelDims.from_config(load_config(job.model))
    resume_from = check_resume(job, dims)
    rows = load_rows(job.data, job.seq_len, job.model, dims.vocab_size)
    check_rows(rows, job)
    check_output(job)
    return JobInputs(dims, rows, resume_from)
