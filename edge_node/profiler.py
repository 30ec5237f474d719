"""On-device profiling: how long this device takes per unit of a shard, at the job's shapes.

The device times the components of one layer built from the job's own
config (same hidden size, head size, activation, attention kernel):
attention over some KV groups, MLP over some column blocks, the norms, and
the vocabulary-parallel LM head with its loss, each forward + backward +
AdamW update. Each component is timed at two sizes, one unit and a realistic
share, and fitted as fixed + units * per-unit: per-call work that does not
shrink with a share (a tenth of the MLP costs more than a tenth of the MLP's
time) is a large part of a small share, and a per-unit cost taken from a
share alone over-predicted a lone device's step by 18-36% (the profiler test, in CI). It also times
its own share of an all-reduce (loopback socket transfer of the payload plus
the reduction), because on a CPU device the collectives run on the same cores
and at the same speed as the compute. About three seconds on a full core;
cached per model shape, batch shape and device, for a day (a device's pace
drifts with heat, background load and updates; `XRONOS_PROFILE_MAX_AGE`,
in hours, changes that).

A LoRA job is profiled with its LoRA applied (`_with_lora`): the base weights frozen (their
backward computes input gradients alone), the target projections with factors, and the update
over the factors; so what the backward costs without weight gradients is measured, and a LoRA
profile has no weight-gradient products to move (its fractions are 0). Its cache key holds the
LoRA options.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from edge_node.memory import available_memory_bytes
from edge_node.model_io import ATTN_IMPLEMENTATION, load_config
from edge_node.optimizer import adamw
from edge_node.tp.context import TPContext
from edge_node.tp.cross_entropy import causal_lm_loss
from edge_node.tp.lora import LoraLinear
from edge_node.tp.weight_grads import WeightGradQueue, linear_weight_grad_later, weight_grads_later
from xronos.contract.errors import XronosError
from xronos.contract.files import write_atomically
from xronos.contract.job import JobOptions
from xronos.contract.lora import LoraOptions
from xronos.contract.profiles import DeviceProfile, ProfileShape
from xronos.contract.splits import ModelDims


def model_variant(config, dims: ModelDims, layers: int, groups: int, mlp: int, vocab: int):
    c = copy.deepcopy(config)
    c.num_hidden_layers = layers
    c.num_key_value_heads, c.num_attention_heads, c.head_dim = groups, groups * dims.heads_per_group, dims.head_dim
    c.intermediate_size, c.vocab_size = mlp, vocab
    c.pad_token_id = c.bos_token_id = c.eos_token_id = None
    if hasattr(c, "layer_types"):
        c.layer_types = c.layer_types[:layers] if c.layer_types else None
    return AutoModelForCausalLM.from_config(c, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION).train()


WINDOW_SECONDS, WINDOWS = 0.1, 2
"""Each timing spans two windows of at least 0.1 s: under a CPU quota (10 ms periods) a short
run can fall inside one period's allowance and look full-speed, so a window spans ten periods."""


def _window(run) -> tuple[float, int]:
    """(wall seconds, calls) of `run()` called over one window of at least WINDOW_SECONDS."""
    reps, start = 0, time.perf_counter()
    while reps < 1 or time.perf_counter() - start < WINDOW_SECONDS:
        run()
        reps += 1
    return time.perf_counter() - start, reps


def mean_seconds(runs: Mapping[str, Callable[[], object]]) -> dict[str, float]:
    """Each `run()`'s mean wall time per call after one warm-up, over WINDOWS windows.

    The windows take turns across the runs (a, b, c, a, b, c), so a passing disturbance
    (another process, a hypervisor's steal) weighs on one window of each run it meets
    rather than on all of one run's calls. The mean, not the best window: under a quota,
    windows of the same work differ by tens of percent, and the best of two was ~10% faster
    than the steps of the job it planned (it predicted the luckiest pace, not the usual one).
    """
    for run in runs.values():
        run()
    wall, calls = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0)
    for _ in range(WINDOWS):
        for name, run in runs.items():
            seconds, reps = _window(run)
            wall[name] += seconds
            calls[name] += reps
    return {name: wall[name] / calls[name] for name in runs}


class _Parts:
    """Seconds a component's steps spent in all, in their forward pass, in their backward pass, and in
    weight-gradient products computed later (summed over every call, warm-up included: only ratios are
    used)."""

    def __init__(self) -> None:
        self.total = self.forward = self.backward = self.later = 0.0

    def fraction(self, part: float) -> float:
        return part / self.total if self.total > 0 else 0.0


def training_step(
    forward, params: list[torch.Tensor], parts: _Parts | None = None, weight_grads: WeightGradQueue | None = None
):
    """forward + backward + AdamW update of one component, in isolation (timed in `parts`); the
    weight-gradient products its layers defer to `weight_grads` run after the backward. Without
    `params` (a LoRA job's frozen norms or vocabulary), no update."""
    opt = adamw(params, lr=1e-6) if params else None
    parts = parts or _Parts()

    def step():
        t0 = time.perf_counter()
        out = forward().sum()
        t1 = time.perf_counter()
        out.backward()
        t2 = time.perf_counter()
        if weight_grads is not None:
            weight_grads.flush()
        t3 = time.perf_counter()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        parts.forward += t1 - t0
        parts.backward += t2 - t1
        parts.later += t3 - t2
        parts.total += time.perf_counter() - t0

    return step


class _Exchange:
    """This device's share of an all-reduce of `nbytes`: send + receive ~2x the payload, and add it.

    A loopback socket pair, so the cost measured is the device's CPU moving the bytes
    (what it pays in every collective), not a network's.
    """

    def __init__(self, nbytes: int):
        self.a, self.b = socket.socketpair()
        self.payload = bytes(2 * nbytes)
        self.buf = bytearray(2 * nbytes)
        self.x, self.y = torch.ones(nbytes // 4), torch.ones(nbytes // 4)

    def __call__(self) -> None:
        sender = threading.Thread(target=self.a.sendall, args=(self.payload,))
        sender.start()
        view, got = memoryview(self.buf), 0
        while got < len(self.buf):
            got += self.b.recv_into(view[got:])
        self.x.add_(self.y)
        sender.join()

    def __enter__(self) -> _Exchange:
        return self

    def __exit__(self, *exc) -> None:
        self.a.close()
        self.b.close()


MAX_FIXED_FRACTION = 0.5
"""A fitted fixed cost is at most this part of the share's time. Measured fixed costs are 10-45%
of a share's (SmolLM2's MLP: 9% at full speed, 21% at 0.25); a larger one is a noisy slope,
and a per-unit cost driven towards zero would let the plan pile units on that device."""


def fit_fixed_and_per_unit(one_unit: float, share: float, units: int) -> tuple[float, float]:
    """(fixed, per-unit) seconds of a component from its time at one unit and at `units` units.

    The line through both points, anchored at the share (the size plans use most), its slope
    kept between (1 - MAX_FIXED_FRACTION) and 1 times the share's mean per unit: a steeper
    line (superlinear) would need a negative fixed cost, a flatter one is noise. Continuous
    in both timings, so a small change in a timing moves the costs a little.
    """
    if units <= 1:
        return 0.0, share / max(units, 1)
    mean = share / units
    per_unit = min(max((share - one_unit) / (units - 1), (1 - MAX_FIXED_FRACTION) * mean), mean)
    # At the superlinear clamp the fixed cost is 0 up to round-off, which can be -1e-16: a
    # profile must not fail validation on that.
    return max(0.0, share - per_unit * units), per_unit


VOCAB_SAMPLE_ROWS = 3072
"""The vocabulary share timed: a large LM head (SmolLM2's 49152 rows) is one big matmul well
before a quarter of it, and timing a quarter would take most of the profile's time; a small
one needs its quarter, or the loss's fixed work swamps the per-row cost."""

MAX_LATER_FRACTION = 0.6
"""The weight-gradient products are one of a projection's three matrix products per step (~25% of
an MLP share's seconds and ~20-30% of an attention share's, with the update); a larger measured
part is a disturbed window."""

PROFILER_VERSION = 9
"""Part of the cache key: a profile measured by another version of this code is measured anew."""


PROFILE_MAX_AGE_HOURS = 24.0
"""A cached profile older than this is measured anew (`XRONOS_PROFILE_MAX_AGE` overrides)."""


def _max_age_seconds() -> float:
    raw = os.environ.get("XRONOS_PROFILE_MAX_AGE", str(PROFILE_MAX_AGE_HOURS))
    try:
        return float(raw) * 3600
    except ValueError:
        raise XronosError(f"XRONOS_PROFILE_MAX_AGE must be a number of hours, not {raw!r}") from None


def _fresh(cache: Path, max_age_seconds: float) -> bool:
    """Whether a cached profile exists and is young enough to plan with."""
    return cache.is_file() and time.time() - cache.stat().st_mtime <= max_age_seconds


def _cache_path(shape: ProfileShape, device: str, speed_hint: float | None, lora: LoraOptions | None = None) -> Path:
    root = Path(os.environ.get("XRONOS_PROFILE_CACHE", Path.home() / ".cache" / "xronos" / "profiles"))
    parts: list = [shape.model_dump(), device, speed_hint, torch.__version__, PROFILER_VERSION]
    parts += [lora.model_dump(mode="json")] if lora is not None else []  # a full fine-tuning key stays as it was
    key = json.dumps(parts, sort_keys=True)
    return root / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


@torch.no_grad()
def _with_lora(module: torch.nn.Module, names: tuple[str, ...], lora: LoraOptions) -> list[torch.Tensor]:
    """Freeze `module` and give its projections `names` that `lora` targets factors (small random values:
    uninitialised memory may hold denormals, which are slow); returns the factors, what the step updates."""
    module.requires_grad_(False)
    trained = []
    for name in names:
        if name in lora.targets:
            adapted = LoraLinear(getattr(module, name), lora)
            for factor in (adapted.lora_A.weight, adapted.lora_B.weight):
                factor.copy_(torch.randn(factor.shape) * 0.01)
                trained.append(factor)
            setattr(module, name, adapted)
    return trained


def profile_shape(config, micro_batch: int, seq_len: int, threads: int) -> ProfileShape:
    """The shapes a profile is measured at, and cached by: the model's layer sizes, the micro-batch, the threads."""
    dims = ModelDims.from_config(config)
    return ProfileShape(
        hidden_size=dims.hidden_size,
        head_dim=dims.head_dim,
        heads_per_group=dims.heads_per_group,
        micro_batch=micro_batch,
        seq_len=seq_len,
        mlp_block=dims.mlp_block,
        vocab_block=dims.vocab_block,
        threads=threads,
    )


def cached_profile(
    shape: ProfileShape, device: str, speed_hint: float | None, lora: LoraOptions | None
) -> DeviceProfile | None:
    """This device's cached profile at `shape`, if one is young enough to plan with (None: profile afresh)."""
    cache = _cache_path(shape, device, speed_hint, lora)
    return DeviceProfile.model_validate_json(cache.read_text()) if _fresh(cache, _max_age_seconds()) else None


def profile_device(
    config,
    micro_batch: int,
    seq_len: int,
    threads: int,
    device: str,
    speed_hint: float | None = None,
    memory_bytes: int | None = None,
    address: str | None = None,
    use_cache: bool = True,
    lora: LoraOptions | None = None,
) -> DeviceProfile:
    """Measure this device at the job's shapes (or reuse a cached profile of the same shapes), with
    `lora` applied for a LoRA job."""
    dims = ModelDims.from_config(config)
    shape = profile_shape(config, micro_batch, seq_len, threads)
    memory = memory_bytes or available_memory_bytes()
    cached = cached_profile(shape, device, speed_hint, lora) if use_cache else None
    if cached is not None:
        return cached.model_copy(update={"memory_bytes": memory, "address": address})

    started = time.perf_counter()
    torch.manual_seed(0)
    # Each component is timed on its own, at one unit and at a realistic share (half the KV
    # groups but at least three, or all when fewer, a quarter of the MLP columns and of the vocabulary, the
    # vocabulary capped at VOCAB_SAMPLE_ROWS), not as differences of whole-model timings:
    # differences of noisy totals under a CPU quota are mostly noise. The fit's per-unit cost
    # is a difference over (share - 1) units: at 1 and 2 KV groups one window's noise made a
    # 1-core device's group cost 7 ms instead of ~25 (and the plan gave it all three groups).
    groups = min(dims.num_kv_heads, max(3, dims.num_kv_heads // 2))
    mlp_units = dims.intermediate_size // dims.mlp_block
    mlp_blocks = max(min(2, mlp_units), mlp_units // 4)
    vocab_units = dims.vocab_size // dims.vocab_block
    vocab_blocks = max(min(2, vocab_units), min(vocab_units // 4, VOCAB_SAMPLE_ROWS // dims.vocab_block))
    h = torch.randn(micro_batch, seq_len, dims.hidden_size, requires_grad=True)
    position_ids = torch.arange(seq_len).unsqueeze(0)
    runs = {}
    trained = lora is None  # the vocabulary's embedding and head train (else frozen)
    tp = TPContext()  # no process group: the loss's all-reduces are no-ops; the deferred products queue here
    parts = {"attention-share": _Parts(), "mlp-share": _Parts(), "vocab-share": _Parts()}  # read at the share
    for size, (g, m, v) in {"share": (groups, mlp_blocks, vocab_blocks), "unit": (1, 1, 1)}.items():
        model = model_variant(config, dims, 1, g, m * dims.mlp_block, 8)
        layer = model.model.layers[0]
        mask = create_causal_mask(
            config=model.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids
        )
        rope = model.model.rotary_emb(h, position_ids=position_ids)
        projections = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
        if lora is not None:
            attention_params, mlp_params = (
                _with_lora(layer.self_attn, projections[0], lora),
                _with_lora(layer.mlp, projections[1], lora),
            )
            layer.input_layernorm.requires_grad_(False)  # the norms are frozen too
            layer.post_attention_layernorm.requires_grad_(False)
        else:
            for name in projections[0]:  # timed as a rank that defers them runs them
                setattr(layer.self_attn, name, weight_grads_later(getattr(layer.self_attn, name), tp.weight_grads))
            for name in projections[1]:  # as on a rank whose weight gradients come later
                setattr(layer.mlp, name, weight_grads_later(getattr(layer.mlp, name), tp.weight_grads))
            attention_params, mlp_params = list(layer.self_attn.parameters()), list(layer.mlp.parameters())
        runs[f"attention-{size}"] = training_step(
            lambda layer=layer, rope=rope, mask=mask: layer.self_attn(
                hidden_states=h, position_embeddings=rope, attention_mask=mask
            )[0],
            attention_params,
            parts.get(f"attention-{size}"),
            tp.weight_grads,
        )
        runs[f"mlp-{size}"] = training_step(
            lambda layer=layer: layer.mlp(h), mlp_params, parts.get(f"mlp-{size}"), tp.weight_grads
        )
        # The vocabulary's share: embedding rows (their dense gradient and update too) and LM head rows,
        # whose weight-gradient product is timed apart (as a rank that computes it later runs it).
        # With LoRA both are frozen: the head's backward computes the input's gradient alone.
        head = torch.nn.Parameter(torch.randn(v * dims.vocab_block, dims.hidden_size) * 0.02, requires_grad=trained)
        embed = head if dims.tie_word_embeddings else torch.nn.Parameter(head.detach().clone(), requires_grad=trained)
        ids = torch.randint(0, head.shape[0], (micro_batch, seq_len))
        runs[f"vocab-{size}"] = training_step(
            lambda head=head, embed=embed, ids=ids: causal_lm_loss(
                linear_weight_grad_later(torch.nn.functional.embedding(ids, embed) + h, head, None, tp.weight_grads)
                if trained
                else torch.nn.functional.linear(torch.nn.functional.embedding(ids, embed) + h, head),
                ids,
                0,
                tp,
            ),
            list({id(p): p for p in (head, embed)}.values()) if trained else [],
            parts.get(f"vocab-{size}"),
            tp.weight_grads,
        )
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]  # the same in either size
    norms = norms if lora is None else []  # frozen: the backward alone
    runs["norms"] = training_step(lambda: layer.post_attention_layernorm(layer.input_layernorm(h)) + h, norms)
    payload = micro_batch * seq_len * dims.hidden_size * 4
    with _Exchange(payload // 16) as small_exchange, _Exchange(payload) as large_exchange:
        seconds = mean_seconds(runs | {"small": small_exchange, "large": large_exchange})

    kv_fixed, per_group = fit_fixed_and_per_unit(seconds["attention-unit"], seconds["attention-share"], groups)
    mlp_fixed, per_mlp = fit_fixed_and_per_unit(seconds["mlp-unit"], seconds["mlp-share"], mlp_blocks)
    vocab_fixed, per_vocab = fit_fixed_and_per_unit(seconds["vocab-unit"], seconds["vocab-share"], vocab_blocks)
    attention, mlp, vocab = parts["attention-share"], parts["mlp-share"], parts["vocab-share"]
    layer_fixed, step_fixed = seconds["norms"], seconds["norms"] / 2  # the final norm; the embedding lookup is cheap
    small, large = seconds["small"], seconds["large"]
    per_mib = max(0.0, (large - small) / ((payload - payload // 16) / 2**20))
    latency = max(0.0, small - per_mib * payload / 16 / 2**20)

    profile = DeviceProfile(
        device=device,
        speed_hint=speed_hint,
        shape=shape,
        kv_group_seconds=per_group,
        mlp_block_seconds=per_mlp,
        vocab_block_seconds=per_vocab,
        layer_fixed_seconds=layer_fixed,
        step_fixed_seconds=step_fixed,
        kv_fixed_seconds=kv_fixed,
        mlp_fixed_seconds=mlp_fixed,
        vocab_fixed_seconds=vocab_fixed,
        mlp_weight_grad_fraction=min(mlp.fraction(mlp.later), MAX_LATER_FRACTION),
        # the span between a layer's backward all-reduces on a rank that computes its products in place
        attention_backward_fraction=attention.fraction(attention.backward + attention.later),
        attention_weight_grad_fraction=min(attention.fraction(attention.later), MAX_LATER_FRACTION),
        # the LM head's product has no fixed part: its seconds per block, against the per-block cost
        vocab_weight_grad_fraction=min(
            vocab.fraction(vocab.later) * seconds["vocab-share"] / (vocab_blocks * per_vocab) if per_vocab > 0 else 0.0,
            MAX_LATER_FRACTION,
        ),
        attention_forward_fraction=attention.fraction(attention.forward),
        mlp_forward_fraction=mlp.fraction(mlp.forward),
        vocab_forward_fraction=vocab.fraction(vocab.forward),
        allreduce_latency_seconds=latency,
        allreduce_seconds_per_mib=per_mib,
        memory_bytes=memory,
        address=address,
        profile_seconds=time.perf_counter() - started,
    )
    if use_cache:
        remember_profile(profile, lora)
    return profile


def remember_profile(profile: DeviceProfile, lora: LoraOptions | None) -> None:
    """Cache `profile` for the next job of its device and shapes (a day: `XRONOS_PROFILE_MAX_AGE`)."""
    cache = _cache_path(profile.shape, profile.device, profile.speed_hint, lora)
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(cache, profile.model_dump_json())


def job_cached_profile(job: JobOptions, threads: int, device: str, speed_hint: float | None) -> DeviceProfile | None:
    """`device`'s cached profile at `job`'s shapes (None: it would profile afresh)."""
    shape = profile_shape(load_config(job.model), job.batch_size // job.grad_accum, job.seq_len, threads)
    return cached_profile(shape, device, speed_hint, job.lora)
