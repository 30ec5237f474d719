"""Bench reference `hf-tp`: transformers' own tensor parallelism, on the same emulated devices.

What a user gets without Xronos: `from_pretrained(path, distributed_config=DistributedConfig(
tp_plan="auto", tp_size=N))`, the model's predefined plan (q/k/v, gate/up column-wise, o/down
row-wise, the embedding and LM head by vocabulary) as DTensors on a gloo CPU device mesh. Each
device is one worker process (`python -m edge_node.hf_tp SPEC.json`) started by
`edge_node.worker_process.start_worker` under the same CPU quota and core packing as the other
modes, and trains the same rows in the same order (`edge_node.data.batch_rows`, the trainer's
micro-batches) with the same AdamW (`edge_node.optimizer`'s hyper-parameters, fused).

A reference, not a mode: it is not in `JobOptions.mode` (a wire contract), saves no model,
has no LoRA, and its collectives run inside DTensor's ops, where they are not timed: a device's
step is all compute in its report, and the bench shows no idle for it.
"""

from __future__ import annotations

import datetime
import resource
import sys
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from edge_node.preflight import job_inputs
from edge_node.worker_process import free_port
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.report import RankResult, RunReport, build_report
from xronos.contract.splits import ModelDims, ShardSplit

HF_TP = "hf-tp"
"""The bench's label for this reference (a run label, never a job's mode)."""


class HfTpSpec(BaseModel):
    """One device's part of an `hf-tp` run (`device` and `quota_file` as `start_worker` expects)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job: JobOptions
    device: int
    """Its rank too: every device takes part."""
    world_size: int
    master_port: int
    rows_file: str
    result_file: str
    threads: int = 1
    show_progress: bool = False
    quota_file: str | None = None
    cpus: list[int] | None = None


def shard_sizes(size: int, world: int) -> list[int]:
    """How DTensor's `Shard` cuts `size` over `world` ranks: torch.chunk's pieces, the last ones smaller."""
    piece = -(-size // world)
    return [max(0, min(piece, size - rank * piece)) for rank in range(world)]


def hf_split(dims: ModelDims, world: int) -> ShardSplit:
    """What each rank holds under transformers' plan, in Xronos's terms (for the report's per-device rows)."""
    return ShardSplit(
        kv_groups=[dims.num_kv_heads // world] * world,
        mlp_columns=shard_sizes(dims.intermediate_size, world),
        vocab_rows=shard_sizes(dims.vocab_size, world),
    )


def check_plan(job: JobOptions, dims: ModelDims, world: int) -> None:
    """What transformers' plan cannot run, as one line, before a worker starts."""
    from edge_node.model_io import load_config

    if job.lora is not None:
        raise XronosError("hf-tp trains the whole model (transformers' TP has no LoRA here): leave out --lora")
    if job.resume:
        raise XronosError("hf-tp starts from --model: it does not resume")
    if not getattr(load_config(job.model), "base_model_tp_plan", None):
        raise XronosError(f"transformers has no tensor-parallel plan for the model in {job.model}")
    heads = dims.num_heads
    if heads % world or dims.num_kv_heads % world:
        raise XronosError(
            f"transformers' tp_plan splits attention heads evenly: {heads} heads and {dims.num_kv_heads} "
            f"KV heads do not divide over {world} devices"
        )


def run_hf_tp(job: JobOptions, speeds: list[float], threads: int = 1, show_progress: bool = True) -> RunReport:
    """Train `job` with transformers' TP on one worker per speed; the report is labelled `hf-tp`."""
    from edge_node.launcher import LocalWorkers, _watch

    started, world = time.perf_counter(), len(speeds)
    dims, rows, _ = job_inputs(job)
    check_plan(job, dims, world)
    local = LocalWorkers(rows, list(speeds), threads, show_progress)
    try:
        port = free_port()
        for device in range(world):
            spec = HfTpSpec(
                job=job,
                device=device,
                world_size=world,
                master_port=port,
                rows_file=str(local.rows_file),
                result_file=str(local.file("result", device)),
                threads=threads,
                show_progress=show_progress and device == 0,
            )
            local.start(spec, device, module="edge_node.hf_tp").rank = device
        _watch(local.workers, Path(job.output))
        results = [local.result(d) for d in range(world)]
        report = build_report(HF_TP, hf_split(dims, world), list(speeds), results)
        return report.model_copy(update={"job_seconds": time.perf_counter() - started})
    finally:
        local.close()


# -- the worker -------------------------------------------------------------------------------


def load_tp_model(spec: HfTpSpec):
    """The model as transformers shards it over the process group (already initialised: gloo)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=spec.world_size)
    return AutoModelForCausalLM.from_pretrained(spec.job.model, distributed_config=config, dtype=torch.float32)


def make_optimizer(model, lr: float):
    """Our AdamW (`edge_node.optimizer`), fused; the fused kernel takes DTensors and plain tensors only
    in separate groups (the norms stay plain, replicated on every rank)."""
    import torch
    from torch.distributed.tensor import DTensor

    from edge_node.optimizer import BETAS, EPS, WEIGHT_DECAY

    sharded = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    groups = [{"params": group} for group in (sharded, plain) if group]
    return torch.optim.AdamW(groups, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)


def local_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())


def train(spec: HfTpSpec) -> RankResult:
    """The trainer's loop (`edge_node.trainer.Trainer.train_step`) on transformers' sharded model."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from edge_node.data import batch_rows

    job, rank = spec.job, spec.device
    torch.set_num_threads(spec.threads)
    torch.manual_seed(job.seed)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec.master_port}",
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=job.collective_timeout),
    )
    model = load_tp_model(spec)
    model.train()
    optimizer = make_optimizer(model, job.lr)
    rows = load_file(spec.rows_file)["input_ids"]
    bar = None
    if spec.show_progress:
        from tqdm import tqdm

        bar = tqdm(total=job.steps, desc=HF_TP, file=sys.stderr, unit="step")
    losses, seconds = [], []
    dist.barrier()  # start the first step's clock together, as the trainer does
    for step in range(job.steps):
        t0 = time.perf_counter()
        batch = rows[batch_rows(step, job.batch_size, len(rows), job.seed, job.shuffle)]
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in batch.chunk(job.grad_accum):
            loss = model(input_ids=micro, labels=micro, use_cache=False).loss / job.grad_accum
            loss.backward()
            total += loss.item()
        optimizer.step()
        seconds.append(time.perf_counter() - t0)
        losses.append(total)
        if bar is not None:
            bar.set_postfix(loss=f"{total:.4f}", step_s=f"{seconds[-1]:.2f}")
            bar.update()
    if bar is not None:
        bar.close()
    result = RankResult(
        rank=rank,
        losses=losses,
        step_seconds=seconds,
        comm_seconds=[0.0] * len(seconds),  # inside DTensor's ops: not timed
        param_bytes=local_bytes(model),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    dist.destroy_process_group()
    return result


def main(argv: list[str]) -> int:
    spec = HfTpSpec.model_validate_json(Path(argv[0]).read_text())
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if spec.quota_file is not None:  # imports unthrottled, as the trainer's worker does; the rest at its speed
        import torch.distributed.tensor  # noqa: F401
        from transformers.distributed import DistributedConfig  # noqa: F401

        from edge_node.cpu_quota import join_quota
        from edge_node.model_io import load_config, model_class

        model_class(load_config(spec.job.model))
        join_quota(spec.quota_file, spec.cpus)
    Path(spec.result_file).write_text(train(spec).model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
