"""One rank's training loop: setup, step, checkpoint, close (the shape of torchtitan's Trainer).

`mode == "single"` trains the plain Hugging Face model with its own loss, the
reference every tensor-parallel mode must match; otherwise the rank trains
its shard with the vocabulary-parallel loss. Everything else (data order,
AdamW, checkpoints, timing) is shared, so differences between modes are the
parallelism alone.

With `job.lora` the model is frozen and only LoRA factors train: a shard gets
Xronos's sharded factors (`edge_node.tp.lora.apply_lora`), single mode gets
peft's (`get_peft_model`, the reference again), both starting from the same
`initial_factor`s. Checkpoints hold the adapter and its AdamW moments
(`edge_node.lora_io`), the output the adapter as peft writes it, or with
`job.merge` the merged model.
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter
from safetensors.torch import load_file

from edge_node import checkpoint
from edge_node.data import batch_rows
from edge_node.lora_io import (
    factors,
    init_factors,
    load_adapter,
    peft_model,
    restore_adapter_optimizer,
    save_adapter,
    save_merged,
)
from edge_node.model_io import SafetensorsReader, empty_shard, full_param_shapes, load_config, load_full, load_shard
from edge_node.optimizer import ADAM_MOMENTS, adam_state, adam_step, adamw
from edge_node.reshard import reshard_tensors
from edge_node.timeline import Timeline
from edge_node.tp.comm import (
    AWAIT_LISTENER_SECONDS,
    SocketStar,
    await_listener,
    broadcast_bytes,
    open_star,
    own_address,
    time_collectives,
)
from edge_node.tp.context import TPContext
from edge_node.tp.cross_entropy import causal_lm_loss
from edge_node.tp.frozen import DTYPES, held_dtype, hold_matrices
from edge_node.tp.lora import apply_lora, init_lora, lora_shapes, lora_slice, sum_lora_grads
from edge_node.tp.plan import param_slice
from edge_node.tp.shared_groups import sum_shared_grads
from xronos.contract.assignment import RankAssignment
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.profiles import SEGMENT_FIELDS, DeviceProfile
from xronos.contract.report import WARMUP_STEPS, CollectiveChoice, RankResult, ReplanCheck, drifted
from xronos.contract.splits import ModelDims, ShardSplit

KEEP_CHECKPOINTS = 2
MAX_RESHARDS, CALIBRATION_CHECKS, CALIBRATION_RESHARDS, MAX_REPLAN_CHECKS = 6, 8, 3, 24
"""Mode xronos checks its split against the measured pace every `replan_after` timed steps, for the
whole job while a re-shard leaves steps to measure it (`reshard_leaves_enough`).

The first CALIBRATION_CHECKS checks (until CALIBRATION_RESHARDS re-shards) re-plan whatever they
measure, over the split's timed steps so far: a check that keeps the split still recalibrates the
profiles, so later checks start from a pace closer to the measured one (the first timed steps
after a start or a re-shard are the noisiest). Later checks measure the last DRIFT_WINDOW timed
steps and re-plan only when a rank drifted from its prediction (`sustained_drift`: a device another
program slowed down, or one that got its CPU back); one that did not costs one small all-gather.
A job re-shards at most MAX_RESHARDS times, so a device whose pace keeps changing cannot make the
ranks re-shard without end, and half of them are left for drift. The report keeps every re-shard
and the first MAX_REPLAN_CHECKS re-plans that kept the split (a long job on a noisy device must
not grow its result by a check every few steps)."""
DRIFT_WINDOW = 4
"""Timed steps a drift check measures (at least `replan_after`): a few, so that a device slowed
mid-job shows within them, not diluted by a long split's history; all of them must be off the
prediction, so that a slow step or two do not."""
TRACE_ENV = "XRONOS_COLLECTIVE_TRACE"
"""A directory: each rank writes there every collective of its training, call by call (`Trainer.write_trace`)."""
RESHARD_MIN_STEPS_LEFT = WARMUP_STEPS + 1
"""A check re-plans only with this many steps left: the new split's warm-up and a step to time it
(the report times the last split alone). Whether the steps left pay the re-shard back is the
gain's to say (`min_replan_gain`)."""


class WorkerSpec(BaseModel):
    """Everything one worker needs to run its part of a job.

    Without an `assignment` (modes `xronos` and `pp`), the worker first profiles itself, writes
    `profile_file`, and waits for `plan_file` (a `RankAssignment`) to tell its rank (or that it
    sits out).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: JobOptions
    device: int
    name: str | None = Field(None, description="The device's name in its profile (default 'device-<device>').")
    assignment: RankAssignment | None = Field(None, description="Its rank and shard, when known at start.")
    speed_hint: float | None = None
    memory_bytes: int | None = None
    profile_file: str | None = None
    plan_file: str | None = None
    head_start: bool = Field(
        False,
        description="Mode xronos run locally, the fastest device: train alone from the first step while the "
        "others profile, and hand the model over when the plan arrives (`edge_node.head_start`).",
    )
    head_start_file: str | None = Field(
        None,
        description="Where the head start's device writes its progress (`HeadStart`), and where the others "
        "read the checkpoint it handed over through.",
    )
    rows_file: str
    resume_from: str | None = Field(
        None, description="The checkpoint to continue from (`--resume`), verified before the worker started."
    )
    result_file: str
    threads: int = 1
    show_progress: bool = False
    progress_file: str | None = Field(None, description="Append one JSON line per step here (read by the node agent).")
    quota_file: str | None = Field(None, description="The cgroup.procs file to join once imports are done (cpu_quota).")
    cpus: list[int] | None = Field(None, description="The cores to run on from joining the quota on (None: any).")
    replicate_checkpoints: bool = Field(
        False,
        description="Every rank keeps the whole of every checkpoint in its own output (node agents: a "
        "checkpoint must outlive the node that wrote it, and each node resumes from its own copy); "
        "without, rank 0 alone writes (`xronos run`: its ranks share one host and one output).",
    )


class Trainer:
    def __init__(self, spec: WorkerSpec, timeline: Timeline | None = None):
        self.timeline = timeline or Timeline()
        """When this worker's start-up phases, first steps, re-shards and save ended (`RankResult.timeline`)."""
        assert spec.assignment is not None and spec.assignment.rank is not None, "a trainer needs its rank"
        self.spec, self.job = spec, spec.job
        self.assignment, self.rank = spec.assignment, spec.assignment.rank
        self.tp = TPContext()
        self.trace_dir = os.environ.get(TRACE_ENV) or None
        self.trace_steps: list[int] = []
        """With tracing on: where each step's collectives begin in `tp.clock.trace`."""
        if self.trace_dir is not None:
            self.tp.clock.trace = []
        assert self.assignment.world_size is not None  # RankAssignment: a rank comes with its world
        self.world = self.assignment.world_size
        # the plain model: mode single, or mode xronos when it chose the fastest device alone
        self.plain = self.job.mode == "single" or self.assignment.plain
        self.tensor_parallel = self.job.mode in ("tp", "xronos") and not self.plain and self.assignment.stages is None
        torch.set_num_threads(spec.threads)
        torch.manual_seed(self.job.seed)
        if self.world > 1 or not self.plain:
            addr, port = self.assignment.master_addr, self.assignment.master_port
            if self.rank != 0 and addr is not None and port is not None:
                await_listener(addr, port, min(AWAIT_LISTENER_SECONDS, self.job.collective_timeout))
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{addr}:{port}",
                rank=self.rank,
                world_size=self.world,
                # gloo's default is 30 minutes: a peer frozen or unplugged would hold the others that long.
                # Every wait of the job must fit in it: the rendezvous, the slowest rank's load before the
                # first barrier, and rank 0 writing a save while the others wait in the next collective.
                timeout=datetime.timedelta(seconds=self.job.collective_timeout),
            )
            self.timeline.mark("process_group")
        rows = self.assignment.split.micro_batch_rows if self.assignment.split is not None else None
        if rows is not None and rows != self.job.batch_size // self.job.grad_accum:
            raise XronosError(
                f"the split shares KV groups by rows of {rows}-row micro-batches, "
                f"but this job's micro-batches have {self.job.batch_size // self.job.grad_accum} rows"
            )
        self.output = Path(self.job.output)
        if self.rank == 0 or spec.replicate_checkpoints:  # a rank that writes: a crashed save's leftovers go
            for leftover in checkpoint.clean_leftovers(self.output):
                print(f"xronos: removed {leftover}, left by an interrupted save", file=sys.stderr)
        resume_from = Path(spec.resume_from) if spec.resume_from is not None else None
        if self.job.resume and resume_from is None:
            raise XronosError("--resume: the worker was given no checkpoint to resume from")
        self.lora = self.job.lora
        self.base_dtype = DTYPES[self.lora.base_dtype] if self.lora is not None else torch.float32
        """What the model's matrices are held in: float32, or a frozen LoRA base's bfloat16 (`edge_node.tp.frozen`)."""
        # an adapter checkpoint holds the factors alone: the base weights are --model's
        source = resume_from if resume_from is not None and self.lora is None else Path(self.job.model)
        config = load_config(source)
        self.dims = ModelDims.from_config(config)
        self.shapes = full_param_shapes(config)
        self.factor_shapes = lora_shapes(self.shapes, self.lora) if self.lora is not None else {}
        self.config = config
        self.model = self.load_model(source, config)
        if self.lora is not None:
            self.model = self.adapt(self.model, resume_from)
        self.optimizer = self.make_optimizer()
        self.measure_from = 0
        self.trained_bytes: int | None = None
        self.reshards, self.replan_checks = 0, 0
        self.planned_latency: float | None = None
        """This device's all-reduce latency as the plan had it, before any check added the steps' excess."""
        self.last_check: ReplanCheck | None = None
        self.replans: list[ReplanCheck] = []
        self.rows = load_file(spec.rows_file)["input_ids"]
        self.start_step = 0
        self.losses: list[float] = []
        if resume_from is not None:
            self._restore(resume_from)
        self.step_seconds: list[float] = []
        self.comm_seconds: list[float] = []
        self.segment_seconds: list[tuple[float, ...]] = []
        """Per step: compute seconds in each segment, SEGMENT_FIELDS' order (`TPContext.clock.segments`)."""
        self.timeline.mark("model_loaded")
        self.collective = self.choose_collective() if self.tensor_parallel and self.world > 1 else None
        if self.collective is not None:
            self.timeline.mark("collective_chosen")
        if dist.is_initialized():
            dist.barrier()  # slow devices also load slowly: start the first step's clock together
            self.timeline.mark("barrier")

    def choose_collective(self) -> CollectiveChoice:
        """The all-reduce of this job's TP group (`edge_node.tp.comm`); every rank must call this.

        The hub is the rank whose profile exchanges bytes cheapest (it moves n-1 times what
        the others do); without profiles (mode tp does not profile), rank 0. Its messages go over
        its own sockets (`open_star`; through gloo where they cannot be opened). `auto` times
        both algorithms at the size of an activation and keeps the faster.
        """
        from xronos.planner.cost_model import collective_seconds

        profiles = self.assignment.profiles
        costs = [collective_seconds(p, self.dims) for p in profiles] if profiles else [0.0]
        hub = costs.index(min(costs))
        algorithm, ring_s, hub_s = self.job.collective, None, None
        star = self.hub_sockets(hub) if algorithm != "ring" else None
        if algorithm == "auto":
            micro_batch = self.job.batch_size // self.job.grad_accum
            ring_s, hub_s = time_collectives(micro_batch * self.job.seq_len * self.dims.hidden_size, hub, star)
            algorithm = "hub" if hub_s < ring_s else "ring"
        if algorithm != "hub" and star is not None:
            star.close()
            star = None
        self.tp.hub, self.tp.star = (hub if algorithm == "hub" else None), star
        return CollectiveChoice(
            algorithm=algorithm,
            hub_rank=hub if algorithm == "hub" else None,
            hub_sockets=star is not None if algorithm == "hub" else None,
            ring_seconds=ring_s,
            hub_seconds=hub_s,
        )

    def hub_sockets(self, hub: int) -> SocketStar | None:
        """The hub's own connections to the other ranks (`edge_node.tp.comm.open_star`), named by the
        address the others reach the hub at: its profile's (a node agent's: the one it uses towards the
        broker, or its `--address`), else this host's towards the rendezvous (`own_address`: every rank
        of `xronos run` is on one host). Collective; None where they could not be opened."""
        profiles = self.assignment.profiles
        master = self.assignment.master_addr or "127.0.0.1"
        host = profiles[hub].address if profiles and profiles[hub].address else None
        return open_star(hub, host or own_address(master), self.job.collective_timeout)

    # -- what this rank holds (overridden by the pipeline trainer) ---------------
    @property
    def split(self) -> ShardSplit:
        """This rank's tensor-parallel split (single mode's is one rank holding all)."""
        if self.assignment.split is None:
            raise XronosError("this rank's assignment has no split")
        return self.assignment.split

    @property
    def profiles(self) -> list[DeviceProfile]:
        """Mode xronos: the ranks' profiles, which re-planning starts from."""
        if self.assignment.profiles is None:
            raise XronosError("this rank's assignment has no profiles to re-plan with")
        return self.assignment.profiles

    def load_model(self, source: Path, config):
        if not self.tensor_parallel:
            return load_full(source)
        return self.enter_split(load_shard(source, self.split, self.rank, self.tp, self.base_dtype))

    def adapt(self, model, adapter: Path | None):
        """LoRA: `model` frozen, with the job's factors: the adapter checkpoint's (resuming), or the initial
        ones (`initial_factor`, seeded by the job: the same for every split and for single mode)."""
        assert self.lora is not None
        model = apply_lora(model, self.lora) if self.tensor_parallel else peft_model(model, self.lora)
        if adapter is not None:
            load_adapter(model, adapter, self.lora, self.slice_of, self.rank)
        elif self.tensor_parallel:
            init_lora(model, self.factor_shapes, self.split, self.rank, self.dims, self.job.seed)
        else:
            init_factors(model, self.job.seed)
        return model

    def trained(self) -> dict:
        """The parameters the optimizer steps, by name: all of them, or with LoRA the factors alone."""
        return factors(self.model) if self.lora is not None else dict(self.model.named_parameters())

    def enter_split(self, model):
        """What this rank keeps of its split beside the model (its first vocabulary row); returns the model."""
        self.vocab_start = self.split.interval("vocab_rows", self.rank)[0]
        return model

    def slice_of(self, name: str, rank: int):
        return self.slice_in(self.split, name, rank) if self.tensor_parallel else None

    def slice_in(self, split: ShardSplit, name: str, rank: int):
        """`rank`'s slice of parameter or factor `name` under `split`."""
        return (param_slice if self.lora is None else lora_slice)(name, split, rank, self.dims)

    def checkpoint_key(self, name: str) -> str:
        """The name a local parameter's full tensor has in a checkpoint."""
        return name

    def comm_seconds_of_step(self, wall: float, clock_before: float) -> float:
        return self.tp.clock.seconds - clock_before

    # -- training ---------------------------------------------------------
    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tensor_parallel:
            return self.model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        logits = self.model(input_ids=input_ids, use_cache=False).logits  # (B, T, V_local)
        return causal_lm_loss(logits, input_ids, self.vocab_start, self.tp)

    def train_step(self, step: int) -> float:
        """One optimizer step over the step's rows, in `grad_accum` micro-batches; returns the mean loss."""
        job = self.job
        rows = self.rows[batch_rows(step, job.batch_size, len(self.rows), job.seed, job.shuffle)]
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in rows.chunk(job.grad_accum):
            loss = self.loss(micro) / job.grad_accum
            loss.backward()
            self.tp.weight_grads.flush()
            total += loss.item()
        if self.tensor_parallel and self.lora is not None:
            sum_lora_grads(self.model, self.split, self.rank, self.factor_shapes, self.dims, self.tp)
        elif self.tensor_parallel:
            sum_shared_grads(self.model, self.split, self.rank, self.shapes, self.dims, self.tp)
        self.optimizer.step()
        return total

    def train(self, stop: Callable[[], bool] | None = None) -> bool:
        """Train the job's steps from `start_step` and save the final model; True when it did. `stop`, asked
        after every step but the last, ends the training there without a save (the caller saves what it
        needs: a head start's handoff checkpoint, `steps_done`): False."""
        steps = range(self.start_step, self.job.steps)
        bar = None
        if self.spec.show_progress:
            from tqdm import tqdm

            bar = tqdm(
                total=self.job.steps, initial=self.start_step, desc=f"{self.job.mode}", file=sys.stderr, unit="step"
            )
        for step in steps:
            if self.tp.clock.trace is not None:
                self.trace_steps.append(len(self.tp.clock.trace))
            comm0, segments0, t0 = self.tp.clock.seconds, dict(self.tp.clock.segments), time.perf_counter()
            loss = self.train_step(step)
            self.step_seconds.append(time.perf_counter() - t0)
            self.comm_seconds.append(self.comm_seconds_of_step(self.step_seconds[-1], comm0))
            self.segment_seconds.append(
                tuple(self.tp.clock.segments.get(k, 0.0) - segments0.get(k, 0.0) for k in SEGMENT_FIELDS)
            )
            self.losses.append(loss)
            if step - self.start_step < 2:
                self.timeline.mark(("first_step", "second_step")[step - self.start_step])
            if step + 1 == self.job.steps:
                self.timeline.mark("last_step")
            if self.spec.progress_file:
                self._log_progress(step)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{self.step_seconds[-1]:.2f}")
                bar.update()
            if self.replan_due(step):
                self.replan()
            if stop is not None and step + 1 < self.job.steps and stop():
                if bar is not None:
                    bar.close()
                return False
            every = self.job.checkpoint_every
            if every and (step + 1) % every == 0 and step + 1 < self.job.steps:
                self.save_checkpoint(step + 1)
        if bar is not None:
            bar.close()
        self.write_trace()
        self.trained_bytes = self.param_bytes()  # what training held (a merge may upcast a bfloat16 base)
        self.save_final()
        self.timeline.mark("saved")
        return True

    def write_trace(self) -> None:
        """With `XRONOS_COLLECTIVE_TRACE` set (a directory): this rank's collectives, call by call, and where each
        step's began among them (`benchmarks/collective_trace.py` lays the ranks side by side)."""
        if self.trace_dir is None:
            return
        record = {
            "rank": self.rank,
            "speed": self.spec.speed_hint,
            "steps": self.trace_steps,
            "calls": self.tp.clock.trace,
        }
        directory = Path(self.trace_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank-{self.rank}.json").write_text(json.dumps(record))

    @property
    def steps_done(self) -> int:
        """The job's steps trained so far, a resumed checkpoint's included."""
        return self.start_step + len(self.step_seconds)

    def _log_progress(self, step: int) -> None:
        """One line per step for the node agent: loss, and this rank's compute, comm and idle seconds.

        Idle needs the slowest rank's compute, so the ranks agree on it with one scalar
        all-reduce, outside the timed step (only when an agent asked for progress).
        """
        compute = self.step_seconds[-1] - self.comm_seconds[-1]
        slowest = torch.tensor([compute])
        if dist.is_initialized():
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        line = {
            "step": step + 1,
            "loss": self.losses[-1],
            "step_seconds": self.step_seconds[-1],
            "comm_seconds": self.comm_seconds[-1],
            "compute_seconds": compute,
            "idle_seconds": max(0.0, slowest.item() - compute),
            "tokens": self.job.batch_size * self.job.seq_len,
            **self.shard_held(),
        }
        assert self.spec.progress_file is not None  # checked by the caller
        with open(self.spec.progress_file, "a") as out:
            out.write(json.dumps(line) + "\n")

    def shard_held(self) -> dict:
        """What this rank holds now (a re-shard changes it mid-job), for the progress line.

        KV groups count a row share as its fraction of a group; single mode holds everything.
        """
        dims = self.dims
        if self.tensor_parallel:
            kv, mlp, vocab = self.split.shares()[self.rank]
        else:
            kv, mlp, vocab = dims.num_kv_heads, dims.intermediate_size, dims.vocab_size
        return {
            "kv_groups": kv,
            "mlp_columns": mlp,
            "vocab_rows": vocab,
            "layers": dims.num_layers,
            "param_bytes": self.param_bytes(),
        }

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    # -- re-planning from measured compute ------------------------------------------
    def can_replan(self) -> bool:
        return (
            self.job.mode == "xronos"
            and self.assignment.profiles is not None
            and self.world > 1
            and self.job.replan_after > 0
            and self.reshards < MAX_RESHARDS
        )

    def reshard_leaves_enough(self, step: int) -> bool:
        """Whether a re-shard after `step` leaves the steps that measure the new split.

        The steps after a re-shard warm up again and the report times only the last split, so a
        re-shard must leave its warm-up and a timed step (RESHARD_MIN_STEPS_LEFT). Whether the
        steps left pay its seconds back is for the gain to say (`min_replan_gain`).
        """
        return self.job.steps - (step + 1) >= RESHARD_MIN_STEPS_LEFT

    def replan_due(self, step: int) -> bool:
        """Whether a check runs after `step`: every `replan_after` timed steps of the current split,
        while a re-shard would leave enough steps; a drift check once the split has a whole window."""
        if not (self.can_replan() and self.reshard_leaves_enough(step)):
            return False
        timed = len(self.step_seconds) - self.timed_from()
        if timed <= 0 or timed % self.job.replan_after:
            return False
        return self.calibrating() or timed >= self.drift_window()

    def calibrating(self) -> bool:
        """Whether the next check is one of the job's first, which re-plan whatever they measure."""
        return self.replan_checks < CALIBRATION_CHECKS and self.reshards < CALIBRATION_RESHARDS

    def drift_window(self) -> int:
        return max(self.job.replan_after, DRIFT_WINDOW)

    def sustained_drift(self, compute: list[float]) -> float:
        """This rank's compute in each of these steps over its profile's prediction: the ratio nearest 1
        when every step is off the same way, else 1.0 (a step or two off is noise, not a slower or
        faster device; CPU quotas in 4 ms periods on shared cores vary single steps by ~15%)."""
        from xronos.planner.replan import predicted_compute

        predicted = predicted_compute(self.profiles, self.dims, self.split)[self.rank] * self.job.grad_accum
        ratios = [c / predicted for c in compute] if predicted > 0 else [1.0]
        return min(ratios) if min(ratios) > 1 else max(ratios) if max(ratios) < 1 else 1.0

    def timed_from(self) -> int:
        """The first step of the current split that counts for timing (not a warm-up)."""
        return self.measure_from if self.measure_from else WARMUP_STEPS

    def measured_steps(self, calibrating: bool) -> range:
        """What a check measures: the current split's timed steps so far (the first checks), or its
        last `drift_window` (the later ones: a pace that changed mid-split shows undiluted)."""
        start, end = self.timed_from(), len(self.step_seconds)
        return range(start if calibrating else max(start, end - self.drift_window()), end)

    def replan(self) -> None:
        """Re-size every shard from the compute each rank really measured, then re-shard in place.

        The steps measured (`measured_steps`) give each rank's compute per step, in all and in its
        attention, MLP and vocabulary segments, and its `sustained_drift`. A drift check ends there
        when no rank drifted beyond DRIFT_THRESHOLD (every rank tells from the same gathered numbers,
        so all agree without a word). Otherwise rank 0 re-plans with profiles scaled to match; a
        changed split is applied in memory, the slices that change hands sent rank to rank (`reshard`).
        """
        from xronos.planner.cost_model import split_step_seconds
        from xronos.planner.replan import MeasuredCompute, Replan, replan

        as_json = TypeAdapter(Replan)  # what rank 0 decided travels as JSON, never pickled

        calibrating = self.calibrating()
        timed = self.measured_steps(calibrating)
        per_micro_step = len(timed) * self.job.grad_accum
        compute = [self.step_seconds[k] - self.comm_seconds[k] for k in timed]
        mine = [
            sum(compute) / per_micro_step,
            *(sum(column) / per_micro_step for column in zip(*(self.segment_seconds[k] for k in timed))),
            sum(self.step_seconds[k] for k in timed) / per_micro_step,
            self.sustained_drift(compute),
        ]
        gathered = [torch.zeros(len(mine)) for _ in range(self.world)]
        dist.all_gather(gathered, torch.tensor(mine))
        if not calibrating and not any(drifted(t[-1].item()) for t in gathered):
            return
        measured = [MeasuredCompute(t[0].item(), tuple(t[1:-2].tolist()), t[-2].item()) for t in gathered]
        self.replan_checks += 1
        if self.planned_latency is None:
            self.planned_latency = self.profiles[self.rank].allreduce_latency_seconds
        decision = None
        if self.rank == 0:
            decision = as_json.dump_json(
                replan(
                    self.profiles,
                    self.dims,
                    self.split,
                    measured,
                    self.job.batch_size // self.job.grad_accum,
                    self.job.seq_len,
                    self.min_replan_gain(sum(self.step_seconds[k] for k in timed) / len(timed)),
                    lora=self.lora,
                )
            )
        new_split, calibrated, predicted, gain = as_json.validate_json(broadcast_bytes(decision))
        self.learn_pace(calibrated[self.rank])
        changed = new_split != self.assignment.split
        accum = self.job.grad_accum
        started = time.perf_counter()
        self.last_check = ReplanCheck(
            after_step=self.steps_done,
            measured_compute_seconds=[m.total * accum for m in measured],
            measured_segment_seconds=[tuple(x * accum for x in m.segments) for m in measured],
            predicted_compute_seconds=[s * accum for s in predicted],
            new_split=new_split if changed else None,
            predicted_gain=gain,
            predicted_step_seconds=split_step_seconds(calibrated, self.dims, new_split) * accum,
        )
        if changed or self.replan_checks <= MAX_REPLAN_CHECKS:
            self.replans.append(self.last_check)
        self.assignment = self.assignment.model_copy(update={"profiles": calibrated})
        if not changed:
            return
        self.reshard(new_split)
        self.replans[-1] = self.replans[-1].model_copy(update={"reshard_seconds": time.perf_counter() - started})
        self.timeline.mark("reshard", self.replans[-1].reshard_seconds)

    def learn_pace(self, calibrated: DeviceProfile) -> None:
        """Cache this device's profile as this check recalibrated it (`edge_node.profiler.remember_profile`):
        the next job of these shapes on this device plans with the pace its steps measured, not the one a
        profile alone measured. Under a CPU quota a device that waits in collectives can compute faster than
        it profiles (the must-show benches' checks have measured 0.65-0.89x of the profiled compute), and a
        profile measured while another program loaded the machine is off more still; either way the next
        job starts where this one's checks got to, and re-shards less (docs/benchmarks.md).

        Its compute, not its collectives: the latency stays the plan's. What an all-reduce costs in a step
        beyond the profile's price (`collective_excess`) is the group's (who is throttled, who waits for
        whom), and the next job may run another group, or none; its own checks learn it again. Cached, the
        excess the test suite's tiny 3-node jobs measured (2.4 ms an all-reduce) priced the next job of
        those nodes, and a recovery's on two of them, above one node alone."""
        from edge_node.profiler import remember_profile

        latency = self.planned_latency if self.planned_latency is not None else calibrated.allreduce_latency_seconds
        remember_profile(calibrated.model_copy(update={"allreduce_latency_seconds": latency}), self.lora)

    def min_replan_gain(self, step_seconds: float) -> float:
        """The gain this check needs to re-shard: `xronos.planner.replan.min_replan_gain`, and at least
        what pays a re-shard's seconds back over the steps left (`payback_gain`): the last one's, or before
        any, the estimate the layout's job time was priced with (`xronos.planner.job_time.reshard_seconds`).
        Counted free, a 320M-parameter model's first re-shard took 9.0 s to save 7.6% of 4.1 s steps over
        the 8 its 12-step job had left (2.5 s; issue 36, docs/benchmarks.md)."""
        from xronos.planner.job_time import reshard_seconds
        from xronos.planner.replan import min_replan_gain, payback_gain

        last = self.last_check
        kept_gain = last.predicted_gain if last is not None and last.new_split is None else None
        timed = [c.reshard_seconds for c in self.replans if c.reshard_seconds is not None]
        cost = timed[-1] if timed else reshard_seconds(self.profiles, self.dims, self.job)
        steps_left = self.job.steps - self.steps_done
        return max(
            min_replan_gain(kept_gain, cost, step_seconds, steps_left), payback_gain(cost, step_seconds, steps_left)
        )

    def reshard(self, new_split: ShardSplit) -> None:
        """Move every rank to `new_split` in memory (`edge_node.reshard`): parameters and AdamW
        moments, each rank receiving only the slices that change hands. With LoRA, the frozen base
        weights move alone and the factors with their moments."""
        self.reshards += 1
        self.measure_from = len(self.step_seconds) + WARMUP_STEPS  # after a re-shard the steps warm up again
        step = adam_step(self.optimizer)
        params, trained = dict(self.model.named_parameters()), self.trained()
        moments = [checkpoint.adam_moments(self.optimizer, trained, key) for key in ADAM_MOMENTS]
        held = {name: [p, *(m[name] for m in moments)] for name, p in trained.items()}
        old_split = self.split
        old_slice_of = lambda name, rank: self.slice_in(old_split, name, rank)  # noqa: E731
        self.assignment = self.assignment.model_copy(update={"split": new_split})
        shapes = self.factor_shapes if self.lora is not None else self.shapes
        moved = reshard_tensors(held, shapes, old_slice_of, self.slice_of, self.rank, self.world)
        if self.lora is not None:
            frozen = {name: [p] for name, p in params.items() if name not in trained}
            dtype_of = partial(held_dtype, base_dtype=self.base_dtype)
            moved |= reshard_tensors(frozen, self.shapes, old_slice_of, self.slice_of, self.rank, self.world, dtype_of)
        del held, params, trained, moments
        model = self.enter_split(empty_shard(self.config, new_split, self.rank, self.tp, self.base_dtype))
        self.model = apply_lora(model, self.lora) if self.lora is not None else model
        self.optimizer = self.make_optimizer()
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                value, *state = moved[name]
                param.copy_(value)
                if param.requires_grad:
                    self.optimizer.state[param] = adam_state(step, state)
        self.model.train()

    # -- checkpoints --------------------------------------------------------
    def _save(
        self, final: Path, with_optimizer: bool, state: dict | None, replicate: bool = False, durable: bool = True
    ) -> None:
        if self.lora is not None:  # the adapter alone, as peft writes it (with its moments: a checkpoint)
            save_adapter(
                final,
                self.model,
                self.lora,
                self.job.model,
                self.factor_shapes,
                self.slice_of,
                self.rank,
                self.world,
                optimizer=self.optimizer if with_optimizer else None,
                trainer_state=state,
                replicate=replicate,
                durable=durable,
            )
            return
        checkpoint.save(
            final,
            Path(self.job.model),
            self.model,
            self.shapes,
            self.slice_of,
            self.rank,
            self.world,
            optimizer=self.optimizer if with_optimizer else None,
            trainer_state=state,
            replicate=replicate,
            durable=durable,
        )

    def save_checkpoint(self, step: int, directory: Path | None = None) -> None:
        """A resumable checkpoint: model, AdamW moments, step and losses so far (on every rank, with
        `replicate_checkpoints`: each then prunes its own); in `directory` instead of the output's
        checkpoints, not pruned with them and not fsynced (a head start's handoff, read back at once on this host:
        `checkpoint.write_checkpoint`)."""
        state = {
            "step": step,
            "model": self.job.model,
            "adam_step": adam_step(self.optimizer),
            "losses": self.losses,
            "replans": [c.model_dump() for c in self.replans],
            "lora": self.lora.model_dump(mode="json") if self.lora is not None else None,
        }
        if directory is not None:
            self._save(directory, True, state, durable=False)
            return
        self._save(checkpoint.checkpoint_dir(self.output, step), True, state, self.spec.replicate_checkpoints)
        if self.rank == 0 or self.spec.replicate_checkpoints:
            checkpoint.prune_checkpoints(self.output, KEEP_CHECKPOINTS)

    def save_final(self) -> None:
        """The fine-tuned model in HF format, directly in `output` (beside `checkpoints/`); with LoRA the
        adapter as peft writes it, or with `merge` the model with the adapter merged in."""
        if self.job.merge:
            hold_matrices(self.model, torch.float32)  # a bfloat16 base: merged in float32, written in float32
            model = self.model.merge_and_unload() if not self.tensor_parallel else self.model
            save_merged(
                self.output / ".final", Path(self.job.model), model, self.shapes, self.slice_of, self.rank, self.world
            )
        else:
            self._save(self.output / ".final", False, None)
        if self.rank == 0:
            checkpoint.promote_files(self.output / ".final", self.output)

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = self.model.parameters() if self.lora is None else self.trained().values()
        return adamw(params, self.job.lr)

    def restore_optimizer(self, directory: Path, step: float) -> None:
        """AdamW moments for this rank's slices, from a checkpoint's full tensors."""
        if self.lora is not None:
            restore_adapter_optimizer(self.optimizer, self.model, directory, self.slice_of, self.rank, step)
            return
        readers = [SafetensorsReader(directory, stem=key) for key in ADAM_MOMENTS]
        for name, param in self.model.named_parameters():
            part = self.slice_of(name, self.rank)
            self.optimizer.state[param] = adam_state(step, [r.read(self.checkpoint_key(name), part) for r in readers])

    def _restore(self, directory: Path) -> None:
        """Continue from a checkpoint: the model was loaded from it; now AdamW and the step."""
        state = json.loads((directory / checkpoint.TRAINER_STATE).read_text())
        self.restore_optimizer(directory, state["adam_step"])
        self.start_step, self.losses = state["step"], list(state["losses"])
        self.replans = [ReplanCheck.model_validate(c) for c in state.get("replans", [])]

    # -- results ------------------------------------------------------------
    def result(self) -> RankResult:
        return RankResult(
            rank=self.rank,
            losses=self.losses,
            step_seconds=self.step_seconds,
            comm_seconds=self.comm_seconds,
            param_bytes=self.trained_bytes if self.trained_bytes is not None else self.param_bytes(),
            measure_from=self.measure_from,
            split=self.assignment.split if self.tensor_parallel else None,
            replans=self.replans,
            segment_seconds=self.segment_seconds if self.tensor_parallel else [],
            peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            collective=self.collective,
            started_at=self.timeline.started_at,
            timeline=self.timeline.events,
        )

    def close(self) -> None:
        if self.tp.star is not None:
            self.tp.star.close()
            self.tp.star = None
        if dist.is_initialized():
            dist.destroy_process_group()
