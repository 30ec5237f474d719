"""Checkpoints in Hugging Face format, written atomically from sharded ranks.

Every rank can compute every rank's slice of every parameter (`tp.plan`), so
gathering needs no metadata exchange: rank 0 receives each non-empty slice
point-to-point and assembles the full tensor, one parameter at a time.
A checkpoint is a plain HF model directory (loadable by `from_pretrained`)
plus, for resuming, the AdamW moments in the same full layout and a
`trainer_state.json`; because it stores full tensors, a job can resume with
a different split or number of ranks. Directories are written under a
temporary name and renamed into place, so a crash never leaves half a
checkpoint behind, and durably: every file and the directory are fsynced
before the rename and the parent after it, so a power cut (what an edge
device gets) leaves the old checkpoint or the new one, never a directory whose
files are still in the page cache (all but a head start's handoff, read back at once on the same
host: `write_checkpoint`'s `durable`). Each checkpoint carries a manifest of its
files' sizes and SHA-256 digests, computed as the bytes are written; a
checkpoint whose files do not match it (truncated, corrupt, or a torn
`trainer_state.json`) is rejected with the reason, and the older one kept
beside it (KEEP_CHECKPOINTS) is used. Leftovers of a crashed save (`.tmp-*`,
`.old-*`) are removed when the next job starts.

Without `replicate` rank 0 alone writes (`xronos run`: the ranks share one
host and one output). With it (jobs over MQTT, one device per rank) every rank
keeps the whole checkpoint in its own output, so that one survives the loss
of any node: rank 0 assembles each sliced tensor and broadcasts it, and every
rank writes the same bytes. Ranks may still share a directory (agents on one
host, a shared mount): publishing and pruning run under a lock there, and a
rank that finds the identical checkpoint already in place drops its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from torch import nn

from edge_node.optimizer import ADAM_MOMENTS
from edge_node.tp.comm import broadcast_bytes
from edge_node.tp.plan import Slice
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.lora import LoraOptions

SliceOf = Callable[[str, int], Slice | None]
"""(parameter name, rank) -> that rank's slice, or None when replicated."""


def sharded_slice(slice_of: SliceOf, name: str, rank: int) -> Slice:
    """`rank`'s slice of a parameter known to be sliced (whether one is depends on its name alone)."""
    part = slice_of(name, rank)
    if part is None:
        raise ValueError(f"parameter {name!r} is sliced on some rank but replicated on rank {rank}")
    return part


MAX_FILE_BYTES = 2 * 1024**3
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json")
ADAPTER_CONFIG = "adapter_config.json"
"""What makes a directory a peft adapter (`edge_node.lora_io`): transformers loads the adapter's base model and
the adapter from a directory that has one, so a full model written over an adapter must not keep it."""
CHECKPOINTS = "checkpoints"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
LOCK = ".lock"
"""In `checkpoints/`: held while a checkpoint is published or old ones pruned (ranks may share the directory)."""
LEFTOVER_PREFIXES = (".tmp-", ".old-", ".final")
"""Directories only a crashed save leaves behind: temporary, replaced, and the final model's staging."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used, and why (one line)."""


class _DigestingFile:
    """A file being written whose size and SHA-256 are computed from the bytes as they go out."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.sha256, self.bytes = raw, hashlib.sha256(), 0

    def write(self, data) -> None:
        self.sha256.update(data)
        self.bytes += len(memoryview(data).cast("B"))
        self.raw.write(data)

    def digest(self) -> dict:
        return {"bytes": self.bytes, "sha256": self.sha256.hexdigest()}


def file_digest(path: Path) -> dict:
    """Size and SHA-256 of a file, read in 4 MiB pieces."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while piece := f.read(4 << 20):
            sha.update(piece)
            size += len(piece)
    return {"bytes": size, "sha256": sha.hexdigest()}


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename into it, a new file) survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal(directory: Path, digests: dict[str, dict], durable: bool = True) -> None:
    """Write `directory`'s manifest (files already digested as written, the others digested now) and, when
    `durable`, fsync every file and the directory: what `publish_dir` then renames into place is complete on disk."""
    files = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            if path.name not in digests and durable:
                _fsync_file(path)
            files[path.name] = digests.get(path.name) or file_digest(path)
    manifest = directory / MANIFEST
    with open(manifest, "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        fsync_dir(directory)


def verify(directory: Path) -> None:
    """Raise CheckpointError (one line) unless every file of `directory`'s manifest is there, whole."""
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{directory.name}: no readable {MANIFEST} ({type(err).__name__})") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory.name}: {name} is missing")
        if path.stat().st_size != expected.get("bytes"):
            raise CheckpointError(
                f"{directory.name}: {name} has {path.stat().st_size} bytes, not {expected.get('bytes')}"
            )
        if file_digest(path)["sha256"] != expected.get("sha256"):
            raise CheckpointError(f"{directory.name}: {name} does not match its checksum")
    if TRAINER_STATE not in files:
        raise CheckpointError(f"{directory.name}: no {TRAINER_STATE}")


def clean_leftovers(output: Path) -> list[Path]:
    """Remove what crashed saves left in `output` and its checkpoints (temporary and replaced
    directories); returns what was removed."""
    removed: list[Path] = []
    for parent in (output, output / CHECKPOINTS):
        for path in parent.glob(".*") if parent.is_dir() else []:
            if path.is_dir() and path.name.startswith(LEFTOVER_PREFIXES):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _gather_one(
    name: str, shape: torch.Size, local: Mapping[str, torch.Tensor], slice_of: SliceOf, rank: int, world: int
) -> torch.Tensor | None:
    """A sliced parameter's full tensor on rank 0 (None elsewhere: the others send their slices)."""
    if rank != 0:
        if sharded_slice(slice_of, name, rank).size:
            dist.send(local[name].detach().contiguous(), dst=0)
        return None
    if _whole_on(name, shape, slice_of, world) == 0 and not any(
        sharded_slice(slice_of, name, src).size for src in range(1, world)
    ):
        # rank 0 alone holds it (one rank, a lopsided split): its own tensor, no copy (read at once by the
        # writer, which converts a bfloat16 base to float32 as it writes)
        return local[name].detach()
    full = torch.empty(shape, dtype=torch.float32)
    for src in range(world):
        p = sharded_slice(slice_of, name, src)
        if not p.size:
            continue
        target = full.narrow(p.dim, p.start, p.size)
        if src == 0:
            target.copy_(local[name].detach())
        else:
            buf = torch.empty(target.shape, dtype=torch.float32)
            dist.recv(buf, src=src)
            target.copy_(buf)
    return full


def gather_full(
    local: Mapping[str, torch.Tensor], shapes: dict[str, torch.Size], slice_of: SliceOf, rank: int, world: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) on rank 0; other ranks send their slices and yield nothing.

    All ranks must iterate to the end: each parameter is a round of point-to-point messages.
    """
    for name, shape in shapes.items():
        if slice_of(name, 0) is None:  # replicated: rank 0's copy is the whole tensor
            if rank == 0:
                yield name, local[name].detach()
            continue
        full = _gather_one(name, shape, local, slice_of, rank, world)
        if full is not None:
            yield name, full


def _whole_on(name: str, shape: torch.Size, slice_of: SliceOf, world: int) -> int | None:
    """The rank holding all of a sliced parameter, if one does (a stage's layers, a lopsided split)."""
    for src in range(world):
        p = sharded_slice(slice_of, name, src)
        if p.start == 0 and p.size == shape[p.dim]:
            return src
    return None


def replicate_full(
    local: Mapping[str, torch.Tensor], shapes: dict[str, torch.Size], slice_of: SliceOf, rank: int, world: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) on every rank, each the same bits: rank 0 assembles a sliced tensor
    (as `gather_full` does) and broadcasts it; one a rank holds whole comes straight from it.

    Replicated tensors (norms, row-parallel biases: small) are broadcast from rank 0 as well, so
    the checkpoints of all ranks are identical whatever round-off their copies took. All ranks
    must iterate to the end, in the same order: each parameter is a round of collectives.
    """
    for name, shape in shapes.items():
        if world == 1:
            yield name, local[name].detach()
            continue
        whole = 0 if slice_of(name, 0) is None else _whole_on(name, shape, slice_of, world)
        if whole is None:  # in slices: rank 0 assembles it
            held, src = _gather_one(name, shape, local, slice_of, rank, world), 0
        else:
            held, src = (local[name].detach().contiguous() if rank == whole else None), whole
        full = held if held is not None else torch.empty(shape, dtype=torch.float32)
        dist.broadcast(full, src=src)
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
    meta: dict[str, dict[str, object]] = {"__metadata__": {"format": "pt"}}
    offset = 0
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
    durable: bool = True,
) -> dict[str, dict]:
    """Stream float32 tensors (arriving in `shapes` order) into safetensors files; returns each
    file's size and SHA-256 (for the manifest), computed from the bytes as they were written.

    The shapes are known before any data arrives, so each file's header is
    written first and every tensor goes straight to disk: the writer holds
    one tensor at a time, never the whole model.
    """
    files = plan_files(shapes, stem, max_bytes)
    digests = {}
    for file_name, names in files:
        with open(directory / file_name, "wb") as raw:
            f = _DigestingFile(raw)
            header = _header(names, shapes)
            f.write(len(header).to_bytes(8, "little") + header)
            for expected in names:
                name, tensor = next(tensors)
                assert name == expected and tensor.shape == shapes[name], f"{name} out of order"
                f.write(tensor.detach().to(torch.float32).contiguous().numpy().data)
            if durable:
                raw.flush()
                os.fsync(raw.fileno())
            digests[file_name] = f.digest()
    if len(files) > 1:
        weight_map = {name: file_name for file_name, names in files for name in names}
        (directory / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return digests


def copy_model_files(source: Path, target: Path) -> None:
    """Config, tokenizer and generation files of the source model (everything but weights)."""
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, target / path.name)


def publish_dir(tmp: Path, final: Path, durable: bool = True) -> None:
    """Move a finished directory into place; an older one is removed only after."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if durable:
        fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def checkpoints_locked(output: Path) -> Iterator[None]:
    """Hold `output/checkpoints/.lock`: ranks writing the same directory publish and prune one at a time.
    The kernel drops the lock of a process that dies, so a crashed rank never holds the others up."""
    root = output / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _manifest_bytes(directory: Path) -> bytes | None:
    try:
        return (directory / MANIFEST).read_bytes()
    except OSError:
        return None


def publish_shared(tmp: Path, final: Path) -> None:
    """`publish_dir` for writers that may share `final` (replicated checkpoints, ranks on one host):
    under the lock, a checkpoint already in place with our manifest (the same bytes, by their digests)
    stays and ours is dropped; any other is replaced. Idempotent, and safe for concurrent writers."""
    with checkpoints_locked(final.parent.parent):
        if final.is_dir() and _manifest_bytes(final) == _manifest_bytes(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        publish_dir(tmp, final)


def promote_files(finished: Path, target: Path) -> None:
    """Move a finished model's files into `target` (one atomic rename each), dropping stale weights and a
    stale adapter config (a full model written over an adapter, or an adapter over a full model)."""
    new = {path.name for path in finished.iterdir()}
    for path in target.iterdir():
        stale = path.name.endswith(WEIGHT_SUFFIXES) or path.name == ADAPTER_CONFIG
        if path.is_file() and stale and path.name not in new:
            path.unlink()
    for name in sorted(new, key=lambda n: n.endswith(WEIGHT_SUFFIXES)):  # weights last
        os.replace(finished / name, target / name)
    finished.rmdir()
    fsync_dir(target)


def _temp_dir(final: Path, rank: int = 0) -> Path:
    tmp = final.with_name(f".tmp-{final.name}-{rank}-{os.getpid()}")
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


def write_checkpoint(
    final: Path,
    params: dict[str, nn.Parameter],
    shapes: dict[str, torch.Size],
    slice_of: SliceOf,
    rank: int,
    world: int,
    stem: str,
    companions: Callable[[Path], None],
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict | None = None,
    replicate: bool = False,
    rename: Callable[[str], str] = lambda name: name,
    durable: bool = True,
) -> None:
    """Collective: write `params` (and their AdamW moments) of all ranks to `final` as safetensors files
    `stem*` (tensor names through `rename`), with the files `companions` writes beside them: on rank 0,
    or with `replicate` on every rank, each the same bytes (rank 0's trainer state; see the module's
    docstring). The one way a model, a checkpoint or an adapter is written. Not `durable`: nothing fsynced, for
    a checkpoint read back at once on the same host and worth nothing after a power cut (a head start's
    handoff: 283 MB took 0.64-0.77 s fsynced, 0.50-0.53 s without and without `_gather_one`'s copy)."""
    tmp = _temp_dir(final, rank) if rank == 0 or replicate else None
    named = {rename(name): shape for name, shape in shapes.items()}
    digests: dict[str, dict] = {}
    full = replicate_full if replicate else gather_full

    def write(file_stem: str, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        if tmp is None:
            list(tensors)  # a sender: gather_full sends as it is iterated
        else:
            named_tensors = ((rename(n), t) for n, t in tensors)
            digests.update(write_safetensors(tmp, file_stem, named, named_tensors, durable=durable))

    write(stem, full(params, shapes, slice_of, rank, world))
    if optimizer is not None:
        for key in ADAM_MOMENTS:
            write(key, full(adam_moments(optimizer, params, key), shapes, slice_of, rank, world))
    state = json.dumps(trainer_state) if trainer_state is not None else None
    if replicate and world > 1 and state is not None:  # its times differ by rank: rank 0's, everywhere
        state = broadcast_bytes(state.encode() if rank == 0 else None).decode()
    if tmp is not None:
        companions(tmp)
        if state is not None:
            (tmp / TRAINER_STATE).write_text(state)
        seal(tmp, digests, durable)
        if replicate:
            publish_shared(tmp, final)
        else:
            publish_dir(tmp, final, durable)


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
    replicate: bool = False,
    durable: bool = True,
) -> None:
    """Collective: the model (and optimizer moments) of all ranks in `final`, Hugging Face's layout
    beside the source model's config and tokenizer files (`write_checkpoint`)."""
    write_checkpoint(
        final,
        dict(model.named_parameters()),
        shapes,
        slice_of,
        rank,
        world,
        "model",
        lambda tmp: copy_model_files(source_model, tmp),
        optimizer=optimizer,
        trainer_state=trainer_state,
        replicate=replicate,
        durable=durable,
    )


def checkpoint_dir(output: Path, step: int) -> Path:
    return output / CHECKPOINTS / f"step-{step:08d}"


def latest_checkpoint(output: Path) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `output` that matches its manifest (None: none does), and why each
    newer one was passed over."""
    root = output / CHECKPOINTS
    rejected: list[str] = []
    for candidate in sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []:
        try:
            verify(candidate)
            return candidate, rejected
        except CheckpointError as err:
            rejected.append(str(err))
    return None, rejected


def sealed_steps(output: Path, since: float | None = None) -> list[int]:
    """The steps of the checkpoints under `output` that hold a manifest (written at or after `since`, a
    time.time(), if given), oldest first: a listing, no file read (what a heartbeat says; `verify` is
    what resuming trusts). A published checkpoint always has one: it is written before the rename."""
    root = output / CHECKPOINTS
    steps = []
    for directory in root.glob("step-*") if root.is_dir() else []:
        number = directory.name.removeprefix("step-")
        manifest = directory / MANIFEST
        if number.isdigit() and manifest.is_file() and (since is None or manifest.stat().st_mtime >= since):
            steps.append(int(number))
    return sorted(steps)


def step_of(checkpoint: Path) -> int:
    """The step of a checkpoint directory (`checkpoint_dir`'s name)."""
    return int(checkpoint.name.removeprefix("step-"))


def newest_sealed_step(output: Path) -> int | None:
    """The newest of `sealed_steps` (None: no checkpoint), or None when `output` cannot be listed."""
    try:
        steps = sealed_steps(output)
    except OSError:
        return None
    return steps[-1] if steps else None


def _chosen_checkpoint(output: Path, step: int) -> Path:
    """`resume_step`'s checkpoint, verified, or a one-line XronosError naming it."""
    found = checkpoint_dir(output, step)
    if not found.is_dir():
        raise XronosError(f"--resume: resume_step {step} has no checkpoint here ({found} is missing)")
    try:
        verify(found)
    except CheckpointError as err:
        raise XronosError(f"--resume: resume_step {step}'s checkpoint cannot be used: {err}") from None
    return found


def _training_of(lora: LoraOptions | dict | None) -> str:
    """How a job trains, in the words of its options: 'by full fine-tuning', 'with --lora 4 (alpha 8, ...)'."""
    if lora is None:
        return "by full fine-tuning"
    lora = LoraOptions.model_validate(lora)
    return (
        f"with --lora {lora.r} (--lora-alpha {lora.lora_alpha}, --lora-dropout {lora.dropout:g}, "
        f"--lora-targets {','.join(lora.targets)}, --lora-base-dtype {lora.base_dtype})"
    )


def resume_point(output: Path, job: JobOptions) -> Path:
    """The checkpoint `--resume` continues from, or a one-line XronosError: none usable (with why the
    newer ones were passed over), one of another `--model` or other LoRA options (or of full fine-tuning for a
    LoRA job, and the reverse), or `--steps` not beyond it.

    With `job.resume_step` it is that step's checkpoint or an error: the controller names the step when
    it resumes a job on the survivors of a lost node, so every rank starts from the same one (a node
    lost mid-save can leave the newest checkpoint sealed on some ranks only)."""
    rejected: list[str] = []
    if job.resume_step is not None:
        found: Path | None = _chosen_checkpoint(output, job.resume_step)
    else:
        found, rejected = latest_checkpoint(output)
    passed_over = f" (passed over: {'; '.join(rejected)})" if rejected else ""
    if found is None:
        raise XronosError(f"--resume: no usable checkpoint under {output / CHECKPOINTS}{passed_over}")
    state = json.loads((found / TRAINER_STATE).read_text())
    if state.get("model", job.model) != job.model:
        raise XronosError(
            f"--resume: {found} was trained from --model {state['model']}, not {job.model}; "
            "resume with that model, or give a new --output"
        )
    theirs = state.get("lora")
    if (LoraOptions.model_validate(theirs) if theirs else None) != job.lora:
        raise XronosError(
            f"--resume: {found} was trained {_training_of(theirs)}, not {_training_of(job.lora)}; resume with "
            "its options, or give a new --output"
        )
    if job.steps <= state["step"]:
        raise XronosError(
            f"--resume: --steps {job.steps} is not beyond the checkpoint's step {state['step']} ({found})"
        )
    if rejected:
        print(f"xronos: warning: resuming from {found.name}{passed_over}", file=sys.stderr)
    return found


def prune_checkpoints(output: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints, under the lock (ranks may share `output`)."""
    root = output / CHECKPOINTS
    if not root.is_dir():
        return
    with checkpoints_locked(output):
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
