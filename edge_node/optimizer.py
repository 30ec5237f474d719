"""The optimizer every mode trains with, and the profiler times: AdamW, fused.

One place, so the profile prices the update the job runs and every mode (single,
tp, xronos, pp) steps the same way. Fused because on a CPU the default AdamW walks
the parameters one tensor at a time, reading and writing each of them, its
gradient and both moments in several passes; the fused kernel makes one
vectorised pass. For SmolLM2-shaped layers (56.6M parameters, one core) that is
0.070 s per update instead of 0.31 s, against 1.74 s of forward and backward at
4 x 128 tokens (`benchmarks/optimizer_bench.py`). The arithmetic is AdamW's either way:
results differ by float32 round-off only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.0
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
"""The per-parameter state AdamW keeps beside `step`, as checkpoints store it."""


def adam_step(optimizer: torch.optim.Optimizer) -> float:
    """How many updates the optimizer has made (every parameter steps together; 0 before the first)."""
    state = optimizer.state.get(next(iter(optimizer.param_groups[0]["params"])), {})
    return float(state.get("step", 0.0))


def adam_state(step: float, moments: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One parameter's AdamW state, restored: its step count and its moments in ADAM_MOMENTS' order."""
    return {"step": torch.tensor(step, dtype=torch.float32), **dict(zip(ADAM_MOMENTS, moments, strict=True))}


def adamw(params: Iterable[torch.Tensor], lr: float) -> torch.optim.AdamW:
    """AdamW with the job's hyper-parameters, fused where the parameters live on the CPU."""
    params = list(params)
    fused = all(p.device.type == "cpu" for p in params)
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=fused or None)
