"""The pipeline-parallel (PP) baseline, made strong: what edge systems such as Asteroid and
PipeEdge do, run by the same engine, data, optimizer and report as the TP modes.

Each rank is one stage holding a contiguous range of decoder layers (the first
also the embedding, the last also the final norm, the LM head and the loss),
built by hand from the Hugging Face modules (the pipelining tracer cannot
train the HF model) and driven by `torch.distributed.pipelining` with a 1F1B
schedule over micro-batches. Parameter names stay Hugging Face's, so loading
reads only the stage's own tensors and export/checkpoints reuse the TP path:
a stage owns whole tensors, expressed as full-or-empty slices.
With tied embeddings the first and last stages each hold a copy and sum their
gradients after every step (as Megatron does), so the copies never diverge.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from edge_node.data import batch_rows
from edge_node.model_io import ATTN_IMPLEMENTATION, SafetensorsReader, reset_rotary
from edge_node.tp.comm import all_reduce
from edge_node.tp.parallelize import HFCausalLM
from edge_node.tp.plan import Slice
from edge_node.trainer import Trainer
from xronos.contract.errors import XronosError

TIED_HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"


class StageModule(nn.Module):
    """Layers [lo, hi) of a HF causal LM, plus the embedding (first) or the head (last)."""

    def __init__(self, full: HFCausalLM, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.config = full.config
        inner: Any = nn.Module()  # keeps Hugging Face's parameter names: model.layers.<i>...
        inner.embed_tokens = full.model.embed_tokens if first else None
        inner.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in range(lo, hi)})
        inner.rotary_emb = full.model.rotary_emb
        inner.norm = full.model.norm if last else None
        self.model: Any = inner
        self.lm_head: Any = full.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x  # (B, T, H)
        position_ids = torch.arange(h.shape[1]).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        position_embeddings = self.model.rotary_emb(h, position_ids=position_ids)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
        if self.lm_head is not None:
            h = self.lm_head(self.model.norm(h))  # (B, T, V)
        return h


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, as Hugging Face computes it."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1))


class TimedStage(PipelineStage):
    """A pipeline stage that measures its own compute (forward and backward of its chunks)."""

    compute_seconds = 0.0

    def _timed(self, run, *args, **kwargs):
        start = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            self.compute_seconds += time.perf_counter() - start

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)


class PipelineTrainer(Trainer):
    """One stage of the PP baseline; everything else is the shared Trainer."""

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world - 1

    @property
    def stages(self) -> list[tuple[int, int]]:
        """Layers [lo, hi) of every rank's stage."""
        if self.assignment.stages is None:
            raise XronosError("this rank's assignment has no pipeline stages")
        return self.assignment.stages

    def load_model(self, source: Path, config):
        lo, hi = self.stages[self.rank]
        with torch.device("meta"):
            full = AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
            )
        stage = StageModule(full, lo, hi, self.first, self.last)
        stage.to_empty(device="cpu")
        reset_rotary(stage, config)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.tied and self.first and self.last:
            stage.lm_head.weight = stage.model.embed_tokens.weight
        reader = SafetensorsReader(source)
        with torch.no_grad():
            for name, param in stage.named_parameters():
                param.copy_(reader.read(self.checkpoint_key(name)))
        self.owner = {name: r for r, (a, b) in enumerate(self.stages) for name in self._names(a, b, r)}
        self.tied_group = (
            dist.new_group([0, self.world - 1], timeout=datetime.timedelta(seconds=self.job.collective_timeout))
            if self.tied and self.world > 1
            else None
        )  # every rank must take part in creating it
        self.stage = TimedStage(stage, self.rank, self.world, torch.device("cpu"))
        self.schedule = Schedule1F1B(self.stage, n_microbatches=self.assignment.micro_batches, loss_fn=causal_lm_loss)
        return stage.train()

    def _names(self, lo: int, hi: int, rank: int) -> list[str]:
        names = [n for n in self.shapes if any(n.startswith(f"model.layers.{i}.") for i in range(lo, hi))]
        if rank == 0:
            names.append(EMBED)
        if rank == self.world - 1:
            names += ["model.norm.weight"] + ([TIED_HEAD] if TIED_HEAD in self.shapes else [])
        return names

    def slice_of(self, name: str, rank: int) -> Slice:
        shape = self.shapes.get(name) or self.shapes[EMBED]
        owner = self.world - 1 if name == TIED_HEAD else self.owner[name]
        return Slice(0, 0, shape[0] if rank == owner else 0)

    def checkpoint_key(self, name: str) -> str:
        return EMBED if name == TIED_HEAD and self.tied else name

    schedule_wait = 0.0
    """Seconds of the last step in the schedule outside the stage's own forward and backward:
    sends, receives, waiting for the neighbouring stages. With the step's collectives (timed
    by `all_reduce`) that is its communication; the optimizer step is compute, as in the TP
    modes and the profile."""

    def comm_seconds_of_step(self, wall: float, clock_before: float) -> float:
        return self.schedule_wait + self.tp.clock.seconds - clock_before

    def shard_held(self) -> dict:
        """A stage holds whole layers; its stall is the schedule's wait (the paper's computation
        stall: the stage's cores wait for a neighbour's activations or gradients)."""
        lo, hi = self.stages[self.rank]
        return {
            "layers": hi - lo,
            "stall_seconds": self.schedule_wait,
            "param_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters()),
        }

    def train_step(self, step: int) -> float:
        job = self.job
        rows = self.rows[batch_rows(step, job.batch_size, len(self.rows), job.seed, job.shuffle)]
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        compute_before, start = self.stage.compute_seconds, time.perf_counter()
        if self.first and self.last:
            self.schedule.step(rows, target=rows, losses=losses)
        elif self.first:
            self.schedule.step(rows)
        elif self.last:
            self.schedule.step(target=rows, losses=losses)
        else:
            self.schedule.step()
        self.schedule_wait = time.perf_counter() - start - (self.stage.compute_seconds - compute_before)
        if self.tied_group is not None and (self.first or self.last):
            weight = self.model.model.embed_tokens.weight if self.first else self.model.lm_head.weight
            all_reduce(weight.grad, self.tp, group=self.tied_group)
        self.optimizer.step()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        all_reduce(loss, self.tp)  # only the last stage has it; the others add zero (exactly)
        return loss.item()
