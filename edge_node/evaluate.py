"""Held-out perplexity of a saved model (or a LoRA adapter on its base): exp(mean next-token loss) over held-out rows."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from edge_node.checkpoint import ADAPTER_CONFIG
from edge_node.model_io import load_full


def load_trained(model_dir: str | os.PathLike) -> torch.nn.Module:
    """A fine-tuned model: a full one, or a peft adapter (`xronos run --lora`) on the base model it names."""
    adapter = Path(model_dir) / ADAPTER_CONFIG
    if not adapter.is_file():
        return load_full(model_dir)
    from peft import PeftModel

    base = json.loads(adapter.read_text())["base_model_name_or_path"]
    return PeftModel.from_pretrained(load_full(base), model_dir)


@torch.no_grad()
def perplexity(model_dir: str | os.PathLike, rows: torch.Tensor, batch_size: int = 8) -> float:
    """Token-weighted mean loss over all rows (each row predicts its last T-1 tokens)."""
    model = load_trained(model_dir).eval()
    total, count = 0.0, 0
    for batch in rows.split(batch_size):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += loss.item() * n
        count += n
    return math.exp(total / count)
