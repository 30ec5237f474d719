"""Training data: rows of token ids, and which rows each step uses.

The contract (docs/command-line.md): a JSONL file of `{"input_ids": [...]}` rows of
equal length, or a plain text file tokenized with the model's tokenizer and
cut into rows of `seq_len`. Without shuffling, step k uses rows
k*B .. k*B+B-1 (wrapping around at the end of an epoch); with shuffling each
epoch is a seeded permutation. The rows of a step are a pure function of the
step number, so every rank picks the same batch and a resumed job continues
exactly where it stopped.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import torch

from xronos.contract.errors import XronosError


def _read_jsonl(path: Path, seq_len: int) -> torch.Tensor:
    rows = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise XronosError(f"{path}:{lineno}: expected a JSON object with an 'input_ids' list") from None
            if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 1 << 63 for t in ids):
                raise XronosError(f"{path}:{lineno}: 'input_ids' must be a list of token ids (whole numbers from 0)")
            if len(ids) < seq_len:
                raise XronosError(f"{path}:{lineno}: row has {len(ids)} tokens, shorter than --seq-len {seq_len}")
            rows.append(ids[:seq_len])
    if not rows:
        raise XronosError(f"{path}: no rows")
    return torch.tensor(rows, dtype=torch.long)


def _read_text(path: Path, seq_len: int, model_dir: str | os.PathLike) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise XronosError(f"{path} is text, but the model in {model_dir} has no usable tokenizer ({err})") from None
    ids = tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
    n_rows = len(ids) // seq_len
    if n_rows == 0:
        raise XronosError(f"{path}: {len(ids)} tokens, fewer than one row of --seq-len {seq_len}")
    return torch.tensor(ids[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def load_rows(path: str | os.PathLike, seq_len: int, model_dir: str | os.PathLike, vocab_size: int) -> torch.Tensor:
    """All rows of the data set as a (N, seq_len) LongTensor, validated against the vocabulary."""
    path = Path(path)
    if not path.is_file():
        raise XronosError(f"data file {str(path)!r} does not exist")
    if seq_len < 2:
        raise XronosError(f"--seq-len must be at least 2 (next-token prediction), got {seq_len}")
    try:
        with path.open() as f:
            first = next((line for line in f if line.strip()), "")
        is_jsonl = path.suffix == ".jsonl" or first.lstrip().startswith("{")
        rows = _read_jsonl(path, seq_len) if is_jsonl else _read_text(path, seq_len, model_dir)
    except UnicodeDecodeError as err:
        raise XronosError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if rows.min() < 0 or rows.max() >= vocab_size:
        raise XronosError(f"{path}: token ids must lie in [0, {vocab_size}) for this model")
    return rows


@lru_cache(maxsize=4)
def _permutation(n_rows: int, seed: int, epoch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_rows, generator=gen).tolist()


def batch_rows(step: int, batch_size: int, n_rows: int, seed: int, shuffle: bool) -> list[int]:
    """Row indices of step `step` (0-based)."""
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, n_rows)
        out.append(_permutation(n_rows, seed, epoch)[pos] if shuffle else pos)
    return out
