"""LoRA options of a job: which projections get low-rank adapters, of what rank and scale.

The same meaning as peft's `LoraConfig` fields of the same role (`r`, `lora_alpha`,
`lora_dropout`, `target_modules`), so an adapter trained here is written as peft writes
it and loads with `peft.PeftModel.from_pretrained`. Like every job option it may arrive
over the network, so its sizes are bounded.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[LoraTarget, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of a Llama-family decoder layer: the default targets."""

MAX_LORA_R = 4096
"""A rank beyond the hidden size of any model an edge cluster trains buys nothing LoRA is for."""


class LoraOptions(BaseModel):
    """LoRA of rank `r` on each target projection: y = W x + b + (alpha / r) * B A dropout(x)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    r: int = Field(ge=1, le=MAX_LORA_R, description="The rank of the factors A (r x in) and B (out x r).")
    alpha: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="The scale numerator (peft's `lora_alpha`, an integer): the delta is multiplied by alpha / r "
        "(None: alpha = r, a scale of 1).",
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapter's input (0: none, and training equals peft's to float round-off).",
    )
    targets: tuple[LoraTarget, ...] = Field(LORA_TARGETS, min_length=1, description="The projections adapted.")
    base_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="What the frozen base matrices (projections, embedding, LM head) are held in. bfloat16 "
        "halves the base's memory, so a device holds twice the shard: the base is frozen, so it only has to "
        "be read, and bfloat16 keeps float32's range (no overflow or scaling to manage) at 8 bits of "
        "mantissa, a rounding of each weight by at most 2^-9 of it. The forward and backward still compute "
        "in float32 (each matrix upcast as it is used); norms, biases, the LoRA factors, their gradients "
        "and AdamW moments stay float32. Off by default: it changes the model trained on (by that rounding).",
    )

    @model_validator(mode="after")
    def _distinct(self) -> LoraOptions:
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {', '.join(self.targets)} name a projection twice")
        return self

    @property
    def lora_alpha(self) -> int:
        """peft's `lora_alpha`: `alpha`, or `r` when not given."""
        return self.alpha if self.alpha is not None else self.r

    @property
    def scaling(self) -> float:
        """What the adapter's output is multiplied by (peft's `scaling`, without rsLoRA)."""
        return self.lora_alpha / self.r
