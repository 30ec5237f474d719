"""Checkpoints in Hugging Face format, written atomically from sharded ranks.

Every rank can compute every rank's slice of every parameter (`tp.plan`), so
gathering needs no metadata exchange: rank 0 receives each non-empty slice
point-to-point and assembles the full tensor, one parameter at a time.
A checkpoint is a plain HF model directory (loadable by `from_pretrained`)
plus, for resuming, the AdamW moments in the same full layout and a
`trainer_state.json`; because it stores full tensors, a job can resume with
a different split or number of ranks. Directories are written under a
temporary name and renamed into place, so a crash never leaves half a
checkpoint behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from edge_node.optimizer import ADAM_MOMENTS
from edge_node.tp.plan import Slice

SliceOf = Callable[[str, int], Slice | None]
"""(parameter name, rank) -> that rank's slice, or None when replicated."""

MAX_FILE_BYTES = 2 * 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"


def gather_full(
    local: dict[str, torch.Tensor], shapes: dict[str, torch.Size], slice_of: SliceOf, rank: int, world: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) on rank 0; other ranks send their slices and yield nothing.

    All ranks must iterate to the end: each parameter is a round of point-to-point messages.
    """
    for name, shape in shapes.items():
        part = slice_of(name, 0)
        if part is None:  # replicated: rank 0's copy is the whole tensor
            if rank == 0:
                yield name, local[name].detach()
            continue
        if rank != 0:
            if slice_of(name, rank).size:
                dist.send(local[name].detach().contiguous(), dst=0)
            continue
        full = torch.empty(shape, dtype=torch.float32)
        for src in range(world):
            p = slice_of(name, src)
            if not p.size:
                continue
            target = full.narrow(p.dim, p.start, p.size)
            if src == 0:
                target.copy_(local[name].detach())
            else:
                buf = torch.empty(target.shape, dtype=torch.float32)
                dist.recv(buf, src=src)
                target.copy_(buf)
        yield name, full


def plan_files(
    shapes: dict[str, torch.Size], stem: str, max_bytes: int = MAX_FILE_BYTES
) -> list[tuple[str, list[str]]]:
    """Assign tensors, in order, to files of at most `max_bytes` (HF's sharded naming when several)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * 4
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return [(f"{stem}.safetensors", groups[0])]
    return [(f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def _header(names: list[str], shapes: dict[str, torch.Size]) -> bytes:
    """A safetensors header for float32 tensors laid out in `names` order, padded to 8 bytes."""
    meta, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        end = offset + shapes[name].numel() * 4
        meta[name] = {"dtype": "F32", "shape": list(shapes[name]), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(
    directory: Path,
    stem: str,
    shapes: dict[str, torch.Size],
    tensors: Iterator[tuple[str, torch.Tensor]],
    max_bytes: int = MAX_FILE_BYTES,
) -> None:
    """Stream float32 tensors (arriving in `shapes` order) into safetensors files.

    The shapes are known before any data arrives, so each file's header is
    written first and every tensor goes straight to disk: the writer holds
    one tensor at a time, never the whole model.
    """
    files = plan_files(shapes, stem, max_bytes)
    for file_name, names in files:
        with open(directory / file_name, "wb") as f:
            header = _header(names, shapes)
            f.write(len(header).to_bytes(8, "little") + header)
            for expected in names:
                name, tensor = next(tensors)
                assert name == expected and tensor.shape == shapes[name], f"{name} out of order"
                f.write(tensor.detach().to(torch.float32).contiguous().numpy().data)
            f.flush()
            os.fsync(f.fileno())
    if len(files) > 1:
        weight_map = {name: file_name for file_name, names in files for name in names}
        (directory / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )


def copy_model_files(source: Path, target: Path) -> None:
    """Config, tokenizer and generation files of the source model (everything but weights)."""
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, target / path.name)


def publish_dir(tmp: Path, final: Path) -> None:
    """Move a finished directory into place; an older one is removed only after."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def promote_files(finished: Path, target: Path) -> None:
    """Move a finished model's files into `target` (one atomic rename each), dropping stale weights."""
    new = {path.name for path in finished.iterdir()}
    for path in target.iterdir():
        if path.is_file() and path.name.endswith(WEIGHT_SUFFIXES) and path.name not in new:
            path.unlink()
    for name in sorted(new, key=lambda n: n.endswith(WEIGHT_SUFFIXES)):  # weights last
        os.replace(finished / name, target / name)
    finished.rmdir()


def _temp_dir(final: Path) -> Path:
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def adam_moments(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], key: str):
    """AdamW's moment `key` of each named parameter (zeros where it has not stepped yet)."""
    out = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {})
        out[name] = state[key] if key in state else torch.zeros_like(p)
    return out


def save(
    final: Path,
    source_model: Path,
    model: nn.Module,
    shapes: dict[str, torch.Size],
    slice_of: SliceOf,
    rank: int,
    world: int,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict | None = None,
) -> None:
    """Collective: write the model (and optimizer moments) of all ranks to `final` on rank 0."""
    params = dict(model.named_parameters())
    tmp = _temp_dir(final) if rank == 0 else None
    write = (lambda stem, it: write_safetensors(tmp, stem, shapes, it)) if rank == 0 else (lambda stem, it: list(it))
    write("model", gather_full(params, shapes, slice_of, rank, world))
    if optimizer is not None:
        for key in ADAM_MOMENTS:
            write(key, gather_full(adam_moments(optimizer, params, key), shapes, slice_of, rank, world))
    if rank == 0:
        copy_model_files(source_model, tmp)
        if trainer_state is not None:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state))
        publish_dir(tmp, final)


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f"step-{step:08d}"


def latest_checkpoint(output: Path) -> Path | None:
    """The newest complete checkpoint under `output`, if any (only complete ones are ever renamed in)."""
    root = output / CHECKPOINTS
    done = sorted(p for p in root.glob("step-*") if (p / TRAINER_STATE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def prune_checkpoints(output: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints."""
    root = output / CHECKPOINTS
    for old in sorted(root.glob("step-*"))[:-keep] if root.is_dir() else []:
        shutil.rmtree(old, ignore_errors=True)
