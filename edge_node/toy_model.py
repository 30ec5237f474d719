"""Small Hugging Face models and data made on the spot (no hub downloads).

Used by `xronos demo`, the tests and the benchmarks. The models are real
`transformers` models, randomly initialised from a config and saved with
`save_pretrained`; the data is a learnable pattern (each row counts up from
a random start with a random stride), so the loss visibly falls.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SMOL_SHAPES = dict(hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152, tie=True)
"""`make_model` keyword arguments for SmolLM2-135M's layer shapes (the benchmarks' model, any depth)."""


ONE_B_CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
)
"""A 1.1B-parameter Llama (TinyLlama's shape), as `LlamaConfig` fields: the model full fine-tuning cannot
place on four 4 GiB devices and LoRA can (the LoRA bench and the planner's memory tests)."""


def make_model(
    directory: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 8,
    kv_heads: int | None = None,
    intermediate: int = 192,
    vocab: int = 256,
    tie: bool = False,
    arch: str = "llama",
    seed: int = 0,
) -> Path:
    """Save a randomly initialised Llama (or Qwen2, with q/k/v bias) model to `directory`."""
    torch.manual_seed(seed)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = cls(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        max_position_embeddings=2048,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return Path(directory)


def make_data(path: str | Path, *, rows: int, seq_len: int, vocab: int, seed: int = 0) -> Path:
    """Write a JSONL file of counting sequences `start + stride * i (mod vocab)`."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (rows, 1), generator=gen)
    strides = torch.randint(1, 4, (rows, 1), generator=gen)
    ids = (starts + strides * torch.arange(seq_len)) % vocab
    Path(path).write_text("".join(json.dumps({"input_ids": row}) + "\n" for row in ids.tolist()))
    return Path(path)
