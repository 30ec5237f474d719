"""Reading a Hugging Face model directory: the whole model, or only one rank's slices.

A rank of a tensor-parallel job builds the model on the meta device (no
memory), swaps in its shard-sized modules, and reads just its slices from the
memory-mapped safetensors files, so a device can hold its part of a model it
could not load whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from edge_node.tp.context import TPContext
from edge_node.tp.frozen import hold_matrices
from edge_node.tp.parallelize import check_supported, parallelize, tie_vocab_shards
from edge_node.tp.plan import Slice, param_slice
from xronos.contract.errors import XronosError
from xronos.contract.splits import ModelDims, ShardSplit

ATTN_IMPLEMENTATION = "sdpa"
"""Same attention kernel for every mode, so losses compare exactly."""


def load_config(model_dir: str | os.PathLike):
    """The model's config, with a readable error for a missing or unsupported model."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise XronosError(f"model directory {str(path)!r} has no config.json (expected a Hugging Face model)")
    config = AutoConfig.from_pretrained(path)
    check_supported(config)
    return config


def model_class(config) -> Any:
    """The transformers class AutoModelForCausalLM builds for `config` (importing its modeling module)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


class SafetensorsReader:
    """Name -> file map over `{stem}.safetensors` (or its HF index), with sliced, memory-mapped reads."""

    def __init__(self, model_dir: str | os.PathLike, stem: str = "model"):
        self.dir = Path(model_dir)
        index = self.dir / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / f"{stem}.safetensors").is_file():
            with safe_open(self.dir / f"{stem}.safetensors", framework="pt") as f:
                weight_map = {name: f"{stem}.safetensors" for name in f.keys()}
        else:
            raise XronosError(f"model directory {str(self.dir)!r} has no {stem} safetensors weights")
        self.weight_map: dict[str, str] = weight_map
        self._files: dict[str, Any] = {}  # safetensors' safe_open handles

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(self.dir / file, framework="pt")
        return self._files[file].get_slice(name)

    def shape(self, name: str) -> torch.Size | None:
        """Tensor `name`'s shape, from the file's header (None: no such tensor)."""
        return torch.Size(self._handle(name).get_shape()) if name in self.weight_map else None

    def read(self, name: str, part: Slice | None = None) -> torch.Tensor:
        """Tensor `name` (or just `part` of it) as float32, contiguous: a slice across columns comes
        as a strided view, and fused AdamW reads moments restored from it as laid out like their
        parameters (a strided moment silently took the wrong elements)."""
        if name not in self.weight_map:
            raise XronosError(f"checkpoint in {str(self.dir)!r} has no tensor {name!r}")
        handle = self._handle(name)
        if part is None:
            tensor = handle[:]
        else:
            index = [slice(None)] * len(handle.get_shape())
            index[part.dim] = slice(part.start, part.stop)
            tensor = handle[tuple(index)]
        return tensor.to(torch.float32).contiguous()


def reset_rotary(model: nn.Module, config) -> None:
    """Recompute non-persistent rotary buffers that `to_empty` left uninitialised."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding"):
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, type(module)(config=config))


def full_param_shapes(config) -> dict[str, torch.Size]:
    """Every parameter of the unsharded model, in a fixed order, with its shape (tied ones once)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return {name: p.shape for name, p in model.named_parameters()}


def empty_shard(
    config, split: ShardSplit, rank: int, tp: TPContext, base_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Rank `rank`'s shard of the model `config` describes, its parameters allocated, not filled; its
    modules share `tp` (`edge_node.tp.context`). `base_dtype`: what its matrices are held in (a frozen
    LoRA base may be bfloat16: `edge_node.tp.frozen`), allocated so (never float32 first)."""
    split.check(ModelDims.from_config(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION)
    parallelize(model, split, rank, tp)
    if base_dtype != torch.float32:
        hold_matrices(model, base_dtype)
    model.to_empty(device="cpu")
    tie_vocab_shards(model)
    reset_rotary(model, config)
    return model


def load_shard(
    model_dir: str | os.PathLike, split: ShardSplit, rank: int, tp: TPContext, base_dtype: torch.dtype = torch.float32
) -> nn.Module:
    """Rank `rank`'s tensor-parallel shard of the model, reading only its own slices (its matrices rounded
    to `base_dtype` as each is read: `empty_shard`)."""
    config = load_config(model_dir)
    dims = ModelDims.from_config(config)
    model = empty_shard(config, split, rank, tp, base_dtype)
    reader = SafetensorsReader(model_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            part = param_slice(name, split, rank, dims)
            param.copy_(reader.read(name, part))
    return model.train()


def load_full(model_dir: str | os.PathLike) -> nn.Module:
    """The whole model through plain `from_pretrained` (the single-process reference)."""
    load_config(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    return model.train()
