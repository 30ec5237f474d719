"""Benchmark: one AdamW update, per-tensor (torch's CPU default) against fused, beside forward + backward.

Builds a SmolLM2-shaped model of `--layers` layers from its config (random
weights, nothing downloaded), runs forward + backward at `--batch` x `--seq-len`
tokens on one thread, then times each AdamW flavour on the same gradients, in
turns (a, b, c, a, b, c: a passing disturbance weighs on one call of each), and
prints the median seconds per update. The update is replicated work every mode
pays once per step (`edge_node.optimizer`). Not a test: numbers, to be quoted.

    python benchmarks/optimizer_bench.py --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from edge_node.optimizer import BETAS, EPS, WEIGHT_DECAY
from edge_node.toy_model import SMOL_SHAPES, make_model

FLAVOURS = {"for-loop (CPU default)": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, layers=args.layers, **SMOL_SHAPES)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).train()
    ids = torch.randint(0, SMOL_SHAPES["vocab"], (args.batch, args.seq_len))
    passes = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        passes.append(time.perf_counter() - start)
    params = list(model.parameters())
    optimizers = {
        name: torch.optim.AdamW(params, lr=1e-6, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **kw)
        for name, kw in FLAVOURS.items()
    }
    seconds = {name: [] for name in optimizers}
    for _ in range(args.repeats + 1):  # the first turn allocates the moments
        for name, opt in optimizers.items():
            start = time.perf_counter()
            opt.step()
            seconds[name].append(time.perf_counter() - start)
    forward_backward = statistics.median(passes[1:])
    print(
        f"{args.layers} layers, {sum(p.numel() for p in params) / 1e6:.1f}M parameters, one thread; "
        f"forward + backward {forward_backward:.3f} s at {args.batch} x {args.seq_len} tokens"
    )
    for name, times in seconds.items():
        update = statistics.median(times[1:])
        print(f"  AdamW {name:<24} {update:.3f} s per update ({update / forward_backward:.0%} of forward + backward)")


if __name__ == "__main__":
    main()
