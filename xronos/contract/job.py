"""The options of a training job, shared by `xronos run` and (later) the MQTT train command."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

Mode = Literal["single", "tp", "xronos", "pp"]
Collective = Literal["auto", "ring", "hub"]
MODES: tuple[str, ...] = ("single", "tp", "xronos", "pp")


class JobOptions(BaseModel):
    """What to train and how; the same for every rank of a job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Local Hugging Face model directory.")
    data: str = Field(description="JSONL of {'input_ids': [...]} rows, or a text file.")
    output: str = Field(description="Directory for the fine-tuned model (HF format) and checkpoints.")
    mode: Mode = "xronos"
    steps: PositiveInt = 10
    batch_size: PositiveInt = Field(8, description="Rows per optimizer step (the global batch).")
    grad_accum: PositiveInt = Field(1, description="Micro-batches per step; must divide batch_size.")
    seq_len: PositiveInt = 128
    lr: PositiveFloat = 1e-4
    seed: int = 0
    shuffle: bool = True
    checkpoint_every: NonNegativeInt = Field(0, description="Checkpoint every N steps (0: only the final model).")
    resume: bool = Field(False, description="Continue from the newest checkpoint under `output`.")
    replan_after: NonNegativeInt = Field(
        2,
        description="Mode xronos: check the split against the measured compute every this many timed steps "
        "and re-shard when that predicts 3% shorter steps (at most 8 checks and 3 re-shards, "
        "in the first half of the job; 0: never).",
    )
    micro_batches: PositiveInt | None = Field(
        None, description="Pipeline mode: micro-batches per step (default: batch_size)."
    )
    collective: Collective = Field(
        "auto",
        description="Modes tp and xronos: how the ranks all-reduce: `ring` (gloo's), `hub` (through the rank "
        "with the cheapest measured exchange; rank 0 without profiles), or `auto` (time both at the "
        "job's activation size before the first step and keep the faster).",
    )

    @model_validator(mode="after")
    def _accumulation_divides_batch(self) -> JobOptions:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--grad-accum {self.grad_accum} must divide --batch-size {self.batch_size}")
        return self
