"""LoRA adapters in and out as peft writes them, and the merged model as plain transformers reads it.

An adapter directory holds `adapter_config.json` (peft's `LoraConfig`) and
`adapter_model.safetensors` (the factors, full, under peft's names), so
`peft.PeftModel.from_pretrained(base_model, directory)` loads it. Written from sharded ranks
like a checkpoint (`edge_node.checkpoint`): rank 0 gathers each factor (`gather_full`: every
rank knows every rank's slice from the split, `lora_slice`), streams it to disk, seals the
directory with a manifest and renames it into place. With the AdamW moments and a trainer
state it is an adapter-only checkpoint: a few MB where the full model's is hundreds, and still
an adapter peft loads. The merged model (`save_merged`) adds each rank's delta into its own
base shard and is then written as any fine-tuned model is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from edge_node.checkpoint import ADAPTER_CONFIG, SliceOf, save, write_checkpoint
from edge_node.model_io import SafetensorsReader
from edge_node.optimizer import ADAM_MOMENTS, adam_state
from edge_node.tp.frozen import DTYPES, hold_matrices
from edge_node.tp.lora import initial_factor, lora_parameters, merge_lora
from xronos.contract.errors import XronosError
from xronos.contract.lora import LoraOptions

ADAPTER_STEM = "adapter_model"
PEFT_PREFIX = "base_model.model."
"""What peft's adapter files put before a parameter's name in the model (PeftModel's `base_model.model`)."""


def peft_key(name: str) -> str:
    """A factor's name in an adapter file: 'model.layers.0.mlp.up_proj.lora_A.weight' ->
    'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight'."""
    return PEFT_PREFIX + name


PEFT_ADAPTER = ".default"
"""The adapter name peft puts in a factor's module path (`...q_proj.lora_A.default.weight`)."""


def peft_model(model: nn.Module, lora: LoraOptions) -> nn.Module:
    """The whole model with peft's LoRA (`get_peft_model`): single mode's reference, its factors not yet
    filled (`init_factors` or `load_adapter`). With `lora.base_dtype` bfloat16 its base matrices are then
    held in bfloat16 as a shard's are (`edge_node.tp.frozen`; after peft, which would otherwise give
    the factors the base's dtype)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets)
    )
    adapted = get_peft_model(model, config)
    return hold_matrices(adapted, DTYPES[lora.base_dtype]) if lora.base_dtype != "float32" else adapted


def factors(model: nn.Module) -> dict[str, nn.Parameter]:
    """The LoRA factors of a model by their names in the base model (`model.layers.0.mlp.up_proj.lora_A.weight`):
    a shard `apply_lora` adapted, or a `peft_model` (its prefix and adapter name taken off)."""
    if not hasattr(model, "peft_config"):
        return lora_parameters(model)
    out = {}
    for name, param in model.named_parameters():
        module_path, _, kind = name.rpartition(".")
        if module_path.endswith(PEFT_ADAPTER) and ".lora_" in module_path:
            out[f"{module_path.removeprefix(PEFT_PREFIX).removesuffix(PEFT_ADAPTER)}.{kind}"] = param
    return out


@torch.no_grad()
def init_factors(model: nn.Module, seed: int) -> None:
    """Fill the whole factors of a `peft_model` with `initial_factor`: what the ranks of a split hold slices of."""
    for name, param in factors(model).items():
        param.copy_(initial_factor(name, param.shape, seed))


def write_adapter_config(directory: Path, lora: LoraOptions, base_model: str | os.PathLike) -> None:
    """`adapter_config.json`, written by peft's own `LoraConfig` (so its fields are the installed peft's)."""
    from peft import LoraConfig

    LoraConfig(
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        task_type="CAUSAL_LM",
        base_model_name_or_path=str(base_model),
        inference_mode=True,
    ).save_pretrained(str(directory))


def check_adapter(directory: Path, lora: LoraOptions) -> None:
    """Raise a one-line XronosError unless the adapter in `directory` has this job's rank and targets."""
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise XronosError(f"{directory}: no readable {ADAPTER_CONFIG} ({type(err).__name__})") from None
    if config.get("r") != lora.r or set(config.get("target_modules") or ()) != set(lora.targets):
        raise XronosError(
            f"{directory}: an adapter of rank {config.get('r')} on {config.get('target_modules')}, "
            f"not --lora {lora.r} on {', '.join(lora.targets)}"
        )


def check_adapter_shapes(directory: Path, lora: LoraOptions, shapes: dict[str, torch.Size]) -> None:
    """Raise a one-line XronosError unless the adapter in `directory` has this job's options and its factors
    the shapes of this model's (`shapes`: `lora_shapes`): an adapter of another model is named before a
    worker starts."""
    check_adapter(directory, lora)
    reader = SafetensorsReader(directory, stem=ADAPTER_STEM)
    for name, shape in shapes.items():
        theirs = reader.shape(peft_key(name))
        if theirs != shape:
            raise XronosError(
                f"{directory}: {name} is {'x'.join(map(str, theirs or ['missing']))}, "
                f"not {'x'.join(map(str, shape))}: an adapter of another model than --model"
            )


def load_adapter(
    model: nn.Module, directory: str | os.PathLike, lora: LoraOptions, slice_of: SliceOf, rank: int
) -> None:
    """Fill the factors of a model `apply_lora` adapted with this rank's slices of a peft adapter
    (or an adapter checkpoint), read memory-mapped."""
    check_adapter(Path(directory), lora)
    reader = SafetensorsReader(directory, stem=ADAPTER_STEM)
    with torch.no_grad():
        for name, param in factors(model).items():
            param.copy_(reader.read(peft_key(name), slice_of(name, rank)))


def restore_adapter_optimizer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    directory: str | os.PathLike,
    slice_of: SliceOf,
    rank: int,
    step: float,
) -> None:
    """AdamW moments of this rank's factor slices, from an adapter checkpoint (`save_adapter` with an optimizer)."""
    readers = [SafetensorsReader(directory, stem=key) for key in ADAM_MOMENTS]
    for name, param in factors(model).items():
        optimizer.state[param] = adam_state(step, [r.read(peft_key(name), slice_of(name, rank)) for r in readers])


def save_adapter(
    final: Path,
    model: nn.Module,
    lora: LoraOptions,
    base_model: str | os.PathLike,
    shapes: dict[str, torch.Size],
    slice_of: SliceOf,
    rank: int,
    world: int,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict | None = None,
    replicate: bool = False,
    durable: bool = True,
) -> None:
    """Collective: write the adapter of all ranks to `final` as peft writes it (`shapes`: `lora_shapes`):
    on rank 0, or with `replicate` on every rank, the same bytes (`edge_node.checkpoint.write_checkpoint`);
    with `optimizer` and `trainer_state`, an adapter-only checkpoint."""
    write_checkpoint(
        final,
        factors(model),
        shapes,
        slice_of,
        rank,
        world,
        ADAPTER_STEM,
        lambda tmp: write_adapter_config(tmp, lora, base_model),
        optimizer=optimizer,
        trainer_state=trainer_state,
        replicate=replicate,
        rename=peft_key,
        durable=durable,
    )


def save_merged(
    final: Path,
    source_model: Path,
    model: nn.Module,
    shapes: dict[str, torch.Size],
    slice_of: SliceOf,
    rank: int,
    world: int,
) -> None:
    """Collective: merge every rank's factors into its base shard (the model stays merged) and write the
    full model to `final` on rank 0 in Hugging Face format (`shapes`: the base model's,
    `full_param_shapes`). A base held in bfloat16 is float32 again first (its held values, exactly),
    so the merge is computed in float32 and the model written in float32."""
    hold_matrices(model, torch.float32)
    merge_lora(model)
    save(final, source_model, model, shapes, slice_of, rank, world)
