"""Simple splits: even (the Megatron TP baseline) and proportional to device speed.

Pure functions. Sizes are split in units of `block` (MLP columns move in
blocks so every shard stays a multiple of a cache-friendly width); a
remainder that is not a whole block goes to the first ranks that own any.
"""

from __future__ import annotations

from fractions import Fraction

from xronos.contract.errors import XronosError
from xronos.contract.splits import ModelDims, ShardSplit


def split_units(total: int, weights: list[float], block: int = 1) -> list[int]:
    """Split `total` into len(weights) integer parts proportional to `weights`.

    Largest-remainder rounding over whole blocks; ties go to the lower rank.
    The tail that is not a whole block is added to the largest part.
    """
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise XronosError(f"weights must be non-negative with a positive sum, got {weights}")
    blocks, tail = divmod(total, block)
    wsum = sum(Fraction(w).limit_denominator(10**6) for w in weights)
    quotas = [Fraction(w).limit_denominator(10**6) / wsum * blocks for w in weights]
    parts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(quotas[r] - parts[r]), r))
    for r in by_remainder[: blocks - sum(parts)]:
        parts[r] += 1
    sizes = [p * block for p in parts]
    sizes[max(range(len(sizes)), key=lambda r: (sizes[r], -r))] += tail
    return sizes


def weighted_split(dims: ModelDims, weights: list[float]) -> ShardSplit:
    """Every dimension split in proportion to `weights` (equal weights = even TP)."""
    return ShardSplit(
        kv_groups=split_units(dims.num_kv_heads, weights),
        mlp_columns=split_units(dims.intermediate_size, weights, dims.mlp_block),
        vocab_rows=split_units(dims.vocab_size, weights, dims.vocab_block),
    ).check(dims)


def even_split(dims: ModelDims, world_size: int) -> ShardSplit:
    """Megatron-style TP baseline: the same share for every rank."""
    return weighted_split(dims, [1.0] * world_size)


def split_for_mode(
    mode: str,
    dims: ModelDims,
    nodes: int,
    speeds: list[float] | None,
    override: dict[str, list[int]] | None = None,
) -> ShardSplit:
    """The split a local run uses: one rank for `single`, even for `tp`, by speed for `xronos`.

    `override` replaces whole dimensions ('kv_groups', 'mlp_columns', 'vocab_rows').
    """
    if mode == "single":
        return weighted_split(dims, [1.0])
    if mode == "tp" or speeds is None:
        split = even_split(dims, nodes)
    elif mode == "xronos":
        split = weighted_split(dims, speeds)
    else:
        raise XronosError(f"unknown mode {mode!r}")
    if override:
        split = ShardSplit(**{**split.model_dump(), **override}).check(dims)
    return split
