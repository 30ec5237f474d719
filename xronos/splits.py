"""How a model is divided between ranks: the shard split and the model sizes it must add up to.

A split is data (it travels in assignments and reports), so it is a frozen,
strict pydantic model. Rank r owns a half-open interval of each dimension:
KV groups [sum(kv_groups[:r]), sum(kv_groups[:r+1])), and likewise for MLP
intermediate columns and vocabulary rows. Zeros are allowed anywhere; the only
rule is that every dimension sums to the model's size, checked in one place
(`ShardSplit.check`).
"""

from __future__ import annotations

from itertools import accumulate

from pydantic import BaseModel, ConfigDict, NonNegativeInt, model_validator

from xronos.errors import XronosError


def _block(total: int, preferred: int) -> int:
    """`preferred`, unless that leaves fewer than 16 blocks: planning needs some resolution."""
    return preferred if total >= 16 * preferred else max(1, total // 16)


class ModelDims(BaseModel):
    """The sizes of a Llama-family model that sharding cares about."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def mlp_block(self) -> int:
        """MLP columns move between ranks in blocks of this many (64, finer for tiny models)."""
        return _block(self.intermediate_size, 64)

    @property
    def vocab_block(self) -> int:
        """Vocabulary rows move in blocks of this many (256, finer for tiny vocabularies)."""
        return _block(self.vocab_size, 256)

    @property
    def heads_per_group(self) -> int:
        """Query heads that travel with one KV head (1 for plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config) -> "ModelDims":
        """Read the sizes from a Hugging Face config (Llama, Mistral, Qwen2 layout)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if config.num_attention_heads % num_kv:
            raise XronosError(
                f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={num_kv}"
            )
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class ShardSplit(BaseModel):
    """Per-rank sizes of each sharded dimension; index = rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_groups: list[NonNegativeInt]
    mlp_columns: list[NonNegativeInt]
    vocab_rows: list[NonNegativeInt]

    @model_validator(mode="after")
    def _same_world(self) -> "ShardSplit":
        sizes = {len(self.kv_groups), len(self.mlp_columns), len(self.vocab_rows)}
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                "kv_groups, mlp_columns and vocab_rows must list one entry per rank "
                f"(got {len(self.kv_groups)}, {len(self.mlp_columns)}, {len(self.vocab_rows)})"
            )
        return self

    @property
    def world_size(self) -> int:
        return len(self.kv_groups)

    def check(self, dims: ModelDims) -> "ShardSplit":
        """Raise a readable XronosError unless every dimension sums to the model's size."""
        for name, parts, total in (
            ("kv_groups", self.kv_groups, dims.num_kv_heads),
            ("mlp_columns", self.mlp_columns, dims.intermediate_size),
            ("vocab_rows", self.vocab_rows, dims.vocab_size),
        ):
            if sum(parts) != total:
                shown = "+".join(map(str, parts))
                raise XronosError(f"split {name} {shown}={sum(parts)} does not sum to the model's {total}")
        return self

    def interval(self, dim: str, rank: int) -> tuple[int, int]:
        """Half-open [start, stop) of `dim` ('kv_groups', 'mlp_columns', 'vocab_rows') owned by `rank`."""
        parts = getattr(self, dim)
        ends = list(accumulate(parts))
        return ends[rank] - parts[rank], ends[rank]

    def describe(self) -> str:
        """One line for terminals: kv 5/2/1 · mlp 128/64/0 · vocab ..."""
        return " · ".join(
            f"{label} {'/'.join(map(str, parts))}"
            for label, parts in (("kv", self.kv_groups), ("mlp", self.mlp_columns), ("vocab", self.vocab_rows))
        )
