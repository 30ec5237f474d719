"""The data contract: JSONL rows, text through the model's tokenizer, and step order."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from edge_node.data import batch_rows, load_rows
from xronos.contract.errors import XronosError


def test_no_shuffle_order_is_the_contract():
    assert batch_rows(0, 4, 10, seed=1, shuffle=False) == [0, 1, 2, 3]
    assert batch_rows(2, 4, 10, seed=1, shuffle=False) == [8, 9, 0, 1]  # wraps into epoch 2


def test_shuffle_is_a_seeded_permutation_per_epoch():
    epoch = [r for step in range(5) for r in batch_rows(step, 2, 10, seed=3, shuffle=True)]
    assert sorted(epoch) == list(range(10)) and epoch != list(range(10))
    assert epoch == [r for step in range(5) for r in batch_rows(step, 2, 10, seed=3, shuffle=True)]
    assert epoch != [r for step in range(5) for r in batch_rows(step, 2, 10, seed=4, shuffle=True)]


def test_jsonl_rows_are_cut_to_seq_len_and_validated(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"input_ids": list(range(i, i + 6))}) for i in range(3)))
    assert load_rows(path, 4, tmp_path, vocab_size=100).tolist() == [[0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]
    with pytest.raises(XronosError, match="shorter than --seq-len 8"):
        load_rows(path, 8, tmp_path, vocab_size=100)
    with pytest.raises(XronosError, match=r"token ids must lie in \[0, 5\)"):
        load_rows(path, 4, tmp_path, vocab_size=5)
    path.write_text('{"tokens": [1, 2]}\n')
    with pytest.raises(XronosError, match="d.jsonl:1: expected a JSON object"):
        load_rows(path, 2, tmp_path, vocab_size=100)


def test_text_file_is_tokenized_with_the_models_tokenizer(tmp_path):
    words = "in the beginning was the word and the word was with god".split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + ["[UNK]"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    text = tmp_path / "book.txt"
    text.write_text(" ".join(words * 3))
    rows = load_rows(text, 5, tmp_path, vocab_size=len(vocab))
    assert rows.shape == (len(words) * 3 // 5, 5)
    assert rows[0].tolist() == [vocab[w] for w in words[:5]]
