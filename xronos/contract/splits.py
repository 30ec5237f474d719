"""How a model is divided between ranks: the shard split and the model sizes it must add up to.

A split is data (it travels in assignments and reports), so it is a frozen,
strict pydantic model. Rank r owns a half-open interval of each dimension:
KV groups [sum(kv_groups[:r]), sum(kv_groups[:r+1])), and likewise for MLP
intermediate columns and vocabulary rows. Zeros are allowed anywhere; the only
rule is that every dimension sums to the model's size, checked in one place
(`ShardSplit.check`).

Attention can be split finer than whole KV groups: with `kv_rows`, neighbouring
ranks share one KV group, each computing it for its own rows of every
micro-batch (attention is independent per sequence). Three KV groups among
three devices of speeds 1, 0.5 and 0.25 are otherwise 2/1/0 at best, and the
slowest device waits through every attention segment; as 2/1[0:3]/1[3:4]
the 0.5 and 0.25 devices share the third group 3 rows to 1. Ranks that
share a group hold its weights alike and sum their gradients of them.
"""

from __future__ import annotations

from itertools import accumulate

from pydantic import BaseModel, ConfigDict, NonNegativeInt, model_validator

from xronos.contract.errors import XronosError


def _block(total: int, preferred: int) -> int:
    """`preferred`, unless that leaves fewer than 16 blocks: planning needs some resolution."""
    return preferred if total >= 16 * preferred else max(1, total // 16)


def kv_label(groups: int, rows: tuple[int, int] | None) -> str:
    """'2' (two whole KV groups) or '1[0:3]' (rows 0..3 of every micro-batch, of one shared group)."""
    return f"{groups}" if rows is None else f"{groups}[{rows[0]}:{rows[1]}]"


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
    def from_config(cls, config) -> ModelDims:
        """Read the sizes from a Hugging Face config (Llama, Mistral, Qwen2 layout)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        if config.num_attention_heads % num_kv:
            raise XronosError(
                f"num_attention_heads={config.num_attention_heads} is not a multiple of num_key_value_heads={num_kv}"
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


WEIGHT_GRADS_LATER = {
    "mlp_columns": "weight_grads_later",
    "kv_groups": "attention_weight_grads_later",
    "vocab_rows": "vocab_rows_later",
}
"""The split dimensions whose weight-gradient products a rank may compute later, and the field that
marks those ranks (see `edge_node.tp.weight_grads`; for the vocabulary, how many of its rows')."""


class ShardSplit(BaseModel):
    """Per-rank sizes of each sharded dimension; index = rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kv_groups: list[NonNegativeInt]
    mlp_columns: list[NonNegativeInt]
    vocab_rows: list[NonNegativeInt]
    kv_rows: list[tuple[NonNegativeInt, NonNegativeInt] | None] | None = None
    """Per rank, None (its KV groups for every row), or [r0, r1): the micro-batch rows it computes
    its one KV group for, which consecutive ranks share until the last row (see the module doc)."""
    weight_grads_later: list[bool] | None = None
    """Per rank, whether its MLP's weight gradients are computed one backward all-reduce later,
    in its wait for the attention of other ranks (`edge_node.tp.weight_grads`); None: on no rank."""
    attention_weight_grads_later: list[bool] | None = None
    """Per rank, whether its attention's weight gradients are computed one backward all-reduce
    later, in the MLP backward of the layer below: the attention segment, which whole KV groups
    cannot balance, loses them, and the MLP segment, which columns balance, takes them."""
    vocab_rows_later: list[NonNegativeInt] | None = None
    """Per rank, how many of its vocabulary rows (its first) have their LM head weight gradients
    computed later, a piece before each layer's attention backward all-reduce, in its wait for the
    attention of other ranks (`edge_node.tp.weight_grads`); None: on no rank."""

    @model_validator(mode="after")
    def _same_world(self) -> ShardSplit:
        sizes = {len(self.kv_groups), len(self.mlp_columns), len(self.vocab_rows)}
        for per_rank in (
            self.kv_rows,
            self.weight_grads_later,
            self.attention_weight_grads_later,
            self.vocab_rows_later,
        ):
            if per_rank is not None:
                sizes.add(len(per_rank))
        if len(sizes) != 1 or 0 in sizes:
            raise ValueError(
                "kv_groups, mlp_columns and vocab_rows must list one entry per rank "
                f"(got {len(self.kv_groups)}, {len(self.mlp_columns)}, {len(self.vocab_rows)})"
            )
        for rank, (later, rows) in enumerate(zip(self.vocab_rows_later or (), self.vocab_rows)):
            if later > rows:
                raise ValueError(f"rank {rank}'s vocab_rows_later {later} exceeds its {rows} vocabulary rows")
        return self

    @property
    def world_size(self) -> int:
        return len(self.kv_groups)

    @property
    def micro_batch_rows(self) -> int | None:
        """The micro-batch size a row-shared split was made for (None: any)."""
        ends = [rows[1] for rows in self.kv_rows or () if rows is not None]
        return max(ends) if ends else None

    def attention_shares(self) -> list[tuple[tuple[int, int], tuple[int, int] | None]]:
        """Per rank: its KV groups [g0, g1), and its rows [r0, r1) of them (None = all rows).

        Raises XronosError for row shares that do not tile their group's rows in rank order.
        """
        shares: list[tuple[tuple[int, int], tuple[int, int] | None]] = []
        pos, open_end = 0, 0
        last = self.micro_batch_rows
        for r in range(self.world_size):
            rows = self.kv_rows[r] if self.kv_rows else None
            if rows is None:
                if open_end:
                    raise XronosError(f"rank {r} takes whole KV groups before group {pos}'s rows are all taken")
                shares.append(((pos, pos + self.kv_groups[r]), None))
                pos += self.kv_groups[r]
                continue
            r0, r1 = rows
            if self.kv_groups[r] != 1 or r0 != open_end or r1 <= r0:
                raise XronosError(f"rank {r}'s rows {r0}:{r1} must be one KV group's next rows (from row {open_end})")
            shares.append(((pos, pos + 1), (r0, r1)))
            open_end = 0 if r1 == last else r1
            pos += 1 if r1 == last else 0
        if open_end:
            raise XronosError(f"KV group {pos}'s rows end at {open_end}, not at {last}")
        return shares

    @property
    def shared_kv_groups(self) -> list[int]:
        """KV groups computed by row shares, in order."""
        return sorted({g for (g, _), rows in self.attention_shares() if rows is not None})

    def shares(self) -> list[tuple[float, int, int]]:
        """Per rank (KV groups' worth of attention work, MLP columns, vocabulary rows):
        a row share counts as its fraction of a group's rows."""
        last = self.micro_batch_rows
        kv = [
            # last is None only when no rank has rows
            g if rows is None or last is None else (rows[1] - rows[0]) / last
            for g, rows in zip(self.kv_groups, self.kv_rows or [None] * self.world_size)
        ]
        return list(zip(kv, self.mlp_columns, self.vocab_rows))

    @property
    def kv_group_total(self) -> int:
        """Distinct KV groups covered (a group shared by rows counts once)."""
        shares = self.attention_shares()
        return shares[-1][0][1] if shares else 0

    def check(self, dims: ModelDims) -> ShardSplit:
        """Raise a readable XronosError unless every dimension sums to the model's size."""
        for name, parts, total in (
            ("kv_groups", self.kv_groups if self.kv_rows is None else [self.kv_group_total], dims.num_kv_heads),
            ("mlp_columns", self.mlp_columns, dims.intermediate_size),
            ("vocab_rows", self.vocab_rows, dims.vocab_size),
        ):
            if sum(parts) != total:
                shown = "+".join(map(str, parts))
                raise XronosError(f"split {name} {shown}={sum(parts)} does not sum to the model's {total}")
        return self

    def interval(self, dim: str, rank: int) -> tuple[int, int]:
        """Half-open [start, stop) of `dim` ('kv_groups', 'mlp_columns', 'vocab_rows') owned by `rank`."""
        if dim == "kv_groups" and self.kv_rows is not None:
            return self.attention_shares()[rank][0]
        parts = getattr(self, dim)
        ends = list(accumulate(parts))
        return ends[rank] - parts[rank], ends[rank]

    def holders(self, dim: str) -> tuple[int, ...]:
        """The ranks that own some of `dim`: the only ones whose partial sums in that dimension's
        all-reduces are not zeros (`edge_node.tp.comm` skips the zeros)."""
        return tuple(r for r in range(self.world_size) if self.interval(dim, r)[0] < self.interval(dim, r)[1])

    def rank_computes_weight_grads_later(self, dim: str, rank: int) -> bool:
        """Whether `rank`'s weight gradients of dimension `dim` come later ('vocab_rows': some of them)."""
        flags = getattr(self, WEIGHT_GRADS_LATER[dim]) if dim in WEIGHT_GRADS_LATER else None
        return bool(flags and flags[rank])

    def vocab_later(self, rank: int) -> int:
        """How many of `rank`'s vocabulary rows have their weight gradients computed later."""
        return self.vocab_rows_later[rank] if self.vocab_rows_later else 0

    def describe(self) -> str:
        """One line for terminals: kv 2*/1[0:3]/1[3:4] · mlp 128/64/0* · vocab 512/256*64/256 ([r0:r1]: rows
        of a shared group; *: that rank's weight gradients of that component come later; *64: of 64 of its
        vocabulary rows)."""
        rows = self.kv_rows or [None] * self.world_size
        star = lambda dim, rank: "*" if self.rank_computes_weight_grads_later(dim, rank) else ""  # noqa: E731
        kv = [kv_label(g, r) + star("kv_groups", rank) for rank, (g, r) in enumerate(zip(self.kv_groups, rows))]
        mlp = [f"{c}{star('mlp_columns', rank)}" for rank, c in enumerate(self.mlp_columns)]
        vocab = [
            f"{c}*{self.vocab_later(rank)}" if self.vocab_later(rank) else f"{c}"
            for rank, c in enumerate(self.vocab_rows)
        ]
        return " · ".join(
            f"{label} {'/'.join(map(str, parts))}" for label, parts in (("kv", kv), ("mlp", mlp), ("vocab", vocab))
        )


SPLIT_KEYS = {"kv": "kv_groups", "mlp": "mlp_columns", "vocab": "vocab_rows", "layers": "layers"}


def parse_split(text: str) -> dict[str, list]:
    """'kv=5/2/1,mlp=128/64/0' -> {'kv_groups': [5, 2, 1], 'mlp_columns': [128, 64, 0]}: the text form
    `ShardSplit.describe` prints (with ',' for ' · ' and '=' for ' '), any dimension left out.

    `layers=2/1/1` gives a pipeline's layers per stage (mode pp); `mlp=128/64*/0*` marks the
    ranks whose MLP weight gradients come later, `kv=1/1/1*` those whose attention's do, and
    `vocab=512/256*64/256` how many of a rank's vocabulary rows' do (as `xronos plan` prints them).
    """
    out = {}
    for item in text.split(","):
        key, _, values = item.partition("=")
        dim = SPLIT_KEYS.get(key.strip())
        if "*" in item and dim not in WEIGHT_GRADS_LATER:
            raise ValueError(f"item {item!r}: only kv, mlp and vocab sizes take a * mark")
        if "*" in item and dim == "vocab_rows":
            try:
                out[WEIGHT_GRADS_LATER[dim]] = [int(v.partition("*")[2]) if "*" in v else 0 for v in values.split("/")]
            except ValueError:
                raise ValueError(
                    f"item {item!r}: a vocabulary size's mark is *ROWS (rows whose weight gradients come later)"
                ) from None
            values = "/".join(v.partition("*")[0] for v in values.split("/"))
        elif "*" in item:
            assert dim is not None  # a * mark outside WEIGHT_GRADS_LATER was rejected above
            out[WEIGHT_GRADS_LATER[dim]] = [v.endswith("*") for v in values.split("/")]
        values = values.replace("*", "")
        if key.strip() not in SPLIT_KEYS or not values:
            raise ValueError(f"item {item!r}: use kv=A/B/..., mlp=A/B/..., vocab=A/B/... separated by commas")
        try:
            out[SPLIT_KEYS[key.strip()]] = [int(v) for v in values.split("/")]
        except ValueError:
            raise ValueError(f"item {item!r}: sizes must be integers") from None
    return out
