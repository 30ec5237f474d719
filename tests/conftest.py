"""Shared fixtures: tiny real Hugging Face models and data, made once per session."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The session's own profile cache: every job's checks teach it (`Trainer.learn_pace`), so a pace learned by an
# earlier run of the suite, or by this machine's other jobs, must not plan these tests.
os.environ["XRONOS_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="xronos-test-profiles-")

import pytest
from transformers.utils import logging as hf_logging

from edge_node.toy_model import make_data, make_model

hf_logging.disable_progress_bar()

SEQ_LEN = 16
VOCAB = 320

MODELS = {
    # name: make_model kwargs
    "mha_untied": dict(hidden=64, layers=2, heads=8, kv_heads=8, intermediate=192, vocab=VOCAB, tie=False),
    "gqa_tied": dict(hidden=48, layers=2, heads=6, kv_heads=3, intermediate=160, vocab=VOCAB, tie=True),
    "qwen2_gqa": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=VOCAB, tie=False, arch="qwen2"),
    # wide enough that sharing pays at speeds 0.8/0.5/0.3 once per-call fixed costs are priced
    # (the plans of the tiny ones often keep one or two devices)
    "gqa_wide": dict(hidden=256, layers=2, heads=8, kv_heads=4, intermediate=1024, vocab=VOCAB, tie=True),
}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name) -> path of a saved tiny model (made once)."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = make_model(tmp_path_factory.mktemp(name) / "model", **MODELS[name], seed=1)
        return made[name]

    return get


@pytest.fixture(scope="session")
def data_file(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "rows.jsonl", rows=40, seq_len=SEQ_LEN + 4, vocab=VOCAB, seed=3)
