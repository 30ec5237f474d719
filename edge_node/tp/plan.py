"""The tensor-parallel plan as data, and which slice of each parameter a rank owns.

Keyed by module path suffix, as in torchtitan's plans. A style names the
kind of parallel layer and the unit its sharded dimension is counted in:
`q` = the query rows of one KV group, `kv` = one KV head, `mlp` = one
intermediate column, `vocab` = one vocabulary row. Which units a rank owns
comes from the split; `param_slice` turns that into a slice of a full
parameter, so every rank can compute every other rank's slice without asking
(loading, exporting and resuming all rely on this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xronos.contract.splits import ModelDims, ShardSplit

Unit = Literal["q", "kv", "mlp", "vocab"]


@dataclass(frozen=True)
class ColumnParallel:
    """Output features split (weight and bias rows); input is replicated."""

    unit: Unit


@dataclass(frozen=True)
class RowParallel:
    """Input features split (weight columns); outputs summed by an all-reduce; bias replicated."""

    unit: Unit


@dataclass(frozen=True)
class VocabParallel:
    """Embedding or LM head: vocabulary rows split."""

    unit: Unit = "vocab"


Style = ColumnParallel | RowParallel | VocabParallel

LAYER_PLAN: dict[str, Style] = {
    "self_attn.q_proj": ColumnParallel("q"),
    "self_attn.k_proj": ColumnParallel("kv"),
    "self_attn.v_proj": ColumnParallel("kv"),
    "self_attn.o_proj": RowParallel("q"),
    "mlp.gate_proj": ColumnParallel("mlp"),
    "mlp.up_proj": ColumnParallel("mlp"),
    "mlp.down_proj": RowParallel("mlp"),
}
"""Applied to every decoder layer `model.layers.<i>`."""

MODEL_PLAN: dict[str, Style] = {
    "model.embed_tokens": VocabParallel(),
    "lm_head": VocabParallel(),
}

_SPLIT_DIM: dict[Unit, str] = {"q": "kv_groups", "kv": "kv_groups", "mlp": "mlp_columns", "vocab": "vocab_rows"}


def split_dim(unit: Unit) -> str:
    """The split dimension a unit is counted in ('kv_groups', 'mlp_columns', 'vocab_rows')."""
    return _SPLIT_DIM[unit]


@dataclass(frozen=True)
class Slice:
    """Rank's part of a full parameter: full.narrow(dim, start, stop - start)."""

    dim: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def unit_width(unit: Unit, dims: ModelDims) -> int:
    """Rows or columns of a parameter per unit of the split."""
    return {"q": dims.heads_per_group * dims.head_dim, "kv": dims.head_dim, "mlp": 1, "vocab": 1}[unit]


def style_of(module_path: str) -> Style | None:
    """The plan entry for a module path such as 'model.layers.3.mlp.up_proj'."""
    if module_path in MODEL_PLAN:
        return MODEL_PLAN[module_path]
    prefix, _, rest = module_path.partition(".layers.")
    if prefix == "model" and rest:
        _, _, suffix = rest.partition(".")
        return LAYER_PLAN.get(suffix)
    return None


def param_slice(param_name: str, split: ShardSplit, rank: int, dims: ModelDims) -> Slice | None:
    """The slice of parameter `param_name` that `rank` owns; None means replicated."""
    module_path, _, kind = param_name.rpartition(".")
    style = style_of(module_path)
    if style is None:
        return None
    if isinstance(style, RowParallel) and kind == "bias":
        return None
    lo, hi = split.interval(split_dim(style.unit), rank)
    width = unit_width(style.unit, dims)
    dim = 1 if isinstance(style, RowParallel) else 0
    return Slice(dim, lo * width, hi * width)
