"""Held-out perplexity of a saved model: exp(mean next-token loss) over held-out rows."""

from __future__ import annotations

import math
import os

import torch

from edge_node.model_io import load_full


@torch.no_grad()
def perplexity(model_dir: str | os.PathLike, rows: torch.Tensor, batch_size: int = 8) -> float:
    """Token-weighted mean loss over all rows (each row predicts its last T-1 tokens)."""
    model = load_full(model_dir).eval()
    total, count = 0.0, 0
    for batch in rows.split(batch_size):
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        n = batch.shape[0] * (batch.shape[1] - 1)
        total += loss.item() * n
        count += n
    return math.exp(total / count)
