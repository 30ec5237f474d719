"""The options of a training job, shared by `xronos run` and the MQTT train command.

A train command arrives from the network, so every size in it is bounded: a
message the schema admits must not make a node allocate without limit, loop for
ever or open a path no file system has. The limits are generous (far beyond any
job an edge cluster runs) and each says why it is where it is; the command line
checks the same bounds (`xronos.cli`) so both give the same reasons.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from xronos.contract.choice import LAYOUTS, Layout
from xronos.contract.lora import LoraOptions

Mode = Literal["single", "tp", "xronos", "pp"]
Collective = Literal["auto", "ring", "hub"]
MODES: tuple[str, ...] = ("single", "tp", "xronos", "pp")

MAX_PATH = 4096
"""Linux's PATH_MAX: no longer path can be opened."""
MAX_STEPS = 10_000_000
"""Ten million optimizer steps: years of steps at edge speeds; a larger count is a typo or an attack."""
MAX_BATCH = 65_536
"""Rows per step; a CPU device holds far fewer (the micro-batch's activations must fit in its memory)."""
MAX_SEQ_LEN = 131_072
"""128 Ki tokens, the longest context of current small Llama-family models."""
MAX_TOKENS_PER_STEP = 1 << 24
"""batch_size x seq_len: 16 Mi tokens a step, 32,768 times the README's 4 x 128."""
MAX_EVERY = MAX_STEPS
"""Checkpoint, re-plan and micro-batch counts: no use beyond the step count's bound."""
MAX_LR = 10.0
"""AdamW diverges long before; a bound that only stops a typo (1e4 for 1e-4) and non-finite values."""
MIN_COLLECTIVE_TIMEOUT, MAX_COLLECTIVE_TIMEOUT = 5.0, 86_400.0
"""Seconds: under 5 s a loaded device's scheduling hiccup would fail healthy jobs; over a day is a typo."""
DEFAULT_COLLECTIVE_TIMEOUT = 300.0
"""Seconds (gloo's own default is 30 minutes): long enough for the slowest device to load its shard
while the others wait at the first barrier, and for rank 0 to finish writing a checkpoint or the
model while the others wait in the next collective (SmolLM2-135M: a few seconds on an SD card);
short enough that a node that stops answering frees its peers within minutes."""
MAX_SEED = 1 << 40
"""|seed|: the data order seeds torch with seed x 1,000,003 + epoch, which must stay within 64 bits."""

NodePath = Annotated[
    str,
    Field(
        min_length=1,
        max_length=MAX_PATH,
        description=f"A path on the nodes (1 to {MAX_PATH} characters).",
    ),
]


class JobOptions(BaseModel):
    """What to train and how; the same for every rank of a job."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: NodePath = Field(description="Local Hugging Face model directory.")
    data: NodePath = Field(description="JSONL of {'input_ids': [...]} rows, or a text file.")
    output: NodePath = Field(description="Directory for the fine-tuned model (HF format) and checkpoints.")
    mode: Mode = "xronos"
    steps: int = Field(10, ge=1, le=MAX_STEPS)
    batch_size: int = Field(8, ge=1, le=MAX_BATCH, description="Rows per optimizer step (the global batch).")
    grad_accum: int = Field(1, ge=1, le=MAX_BATCH, description="Micro-batches per step; must divide batch_size.")
    seq_len: int = Field(128, ge=2, le=MAX_SEQ_LEN, description="Tokens per row (at least 2: next-token prediction).")
    lr: float = Field(1e-4, gt=0, le=MAX_LR, allow_inf_nan=False)
    seed: int = Field(0, ge=-MAX_SEED, le=MAX_SEED)
    shuffle: bool = True
    checkpoint_every: int | None = Field(
        None,
        ge=0,
        le=MAX_EVERY,
        description="Checkpoint every N steps (0: only the final model). None: the controller chooses for a job "
        "over MQTT (checkpoints cost about 5% of its time; every node keeps each whole, so the job survives "
        "the loss of any node); `xronos run` writes only the final model (its ranks share one host).",
    )
    resume: bool = Field(False, description="Continue from the newest checkpoint under `output`.")
    resume_step: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="With `resume`: continue from the checkpoint of exactly this step (default: the newest "
        "usable one). The controller sets it when it resumes a job on the survivors of a lost node, so every "
        "rank starts from the same step.",
    )
    replan_after: int = Field(
        2,
        ge=0,
        le=MAX_EVERY,
        description="Mode xronos: check the split against the measured compute every this many timed steps "
        "and re-shard when that predicts 3% shorter steps; after the first 8 checks (3 re-shards at most), "
        "for the rest of the job, only when a device's measured compute drifts over 10% from the plan in "
        "every step of the last few (at most 6 re-shards in all; 0: never).",
    )
    layouts: tuple[Layout, ...] = Field(
        LAYOUTS,
        min_length=1,
        max_length=len(LAYOUTS),
        description="Mode xronos: the layouts its planner chooses among, by the job's predicted time (start-up "
        "included): `tp` (uneven tensor parallelism on the best set of devices, or the even split over all), "
        "`pp` (the pipeline plan; not for LoRA), `single` (the fastest device alone, the plain model).",
    )
    micro_batches: int | None = Field(
        None, ge=1, le=MAX_BATCH, description="Pipeline mode: micro-batches per step (default: batch_size)."
    )
    collective: Collective = Field(
        "auto",
        description="Modes tp and xronos: how the ranks all-reduce: `ring` (gloo's), `hub` (through the rank "
        "with the cheapest measured exchange; rank 0 without profiles), or `auto` (time both at the "
        "job's activation size before the first step and keep the faster).",
    )

    collective_timeout: float = Field(
        DEFAULT_COLLECTIVE_TIMEOUT,
        ge=MIN_COLLECTIVE_TIMEOUT,
        le=MAX_COLLECTIVE_TIMEOUT,
        allow_inf_nan=False,
        description="Seconds a rank waits in one collective (or the rendezvous) for its peers before it fails "
        "the job: a peer that stopped answering (unplugged, frozen) frees the others after this long. It must "
        "cover the slowest device loading its shard at the start and the ranks writing a checkpoint or the final "
        "model while the others wait.",
    )

    lora: LoraOptions | None = Field(
        None,
        description="Train LoRA adapters instead of every weight: the base model stays frozen (no gradients, no "
        "optimizer state), checkpoints hold the adapter and its AdamW moments, and `output` receives the "
        "adapter as peft writes it (None: full fine-tuning). Not in mode pp.",
    )
    merge: bool = Field(
        False,
        description="With `lora`: write the base model with the trained adapter merged into it to `output` "
        "(a plain Hugging Face model) instead of the adapter.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobOptions:
        if self.merge and self.lora is None:
            raise ValueError("--merge needs --lora (it merges the trained adapter into the model)")
        if self.lora is not None and self.mode == "pp":
            raise ValueError("--lora is not supported in mode pp: use mode xronos, tp or single")
        if len(set(self.layouts)) != len(self.layouts):
            raise ValueError(f"--layouts {','.join(self.layouts)} names a layout twice")
        if self.resume_step is not None and not self.resume:
            raise ValueError(f"resume_step {self.resume_step} needs resume (it names the checkpoint to resume from)")
        if self.resume_step is not None and self.resume_step >= self.steps:
            raise ValueError(f"resume_step {self.resume_step} is not before --steps {self.steps}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--grad-accum {self.grad_accum} must divide --batch-size {self.batch_size}")
        if self.batch_size * self.seq_len > MAX_TOKENS_PER_STEP:
            raise ValueError(
                f"--batch-size {self.batch_size} x --seq-len {self.seq_len} is over {MAX_TOKENS_PER_STEP:,} "
                "tokens a step, more than any device holds"
            )
        return self
