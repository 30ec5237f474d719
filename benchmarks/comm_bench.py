"""Benchmark: what a way of communicating costs a whole training step, variants interleaved step by step.

Starts one process per `--speeds` entry, each under a cgroup v1 quota of that many cores (4 ms
period, as `xronos run` sets them), builds one shard of a small Llama (`edge_node.toy_model`:
hidden 512, 4 layers, 8 heads, 4 KV heads, intermediate 1536, vocabulary 8192) per variant in
every process, each with its own `TPContext`, and trains them all on the same rows, one step of
each variant in turn, so that every variant sees the same load (a background job on the machine
slows all alike). A variant sets `TPContext` attributes (`--variants`, JSON; `"star": true` opens the
hub's own sockets, `open_star`); the default compares the hub through gloo's messages, the hub over
its own sockets (what a job's hub uses) and gloo's ring, a whole step each, not one all-reduce as
`collective_bench.py` does).

Prints, per variant, the median step (the slowest rank's wall time, after the warm-up), its ratio
to the first variant's, the all-reduces per step, each rank's seconds in them, and the largest
relative difference of its per-step losses from the first variant's. Not a test: numbers, to be
quoted. Needs root and the cgroup v1 cpu controller.

    python benchmarks/comm_bench.py --speeds 1,0.5,0.25 --steps 14 --split '{"kv_groups": [2, 2, 0], ...}'

Tried with it and not kept (speeds 1, 0.5, 0.25, the split the planner chose for this model,
kv 2/2/0, MLP 576/512/448, vocabulary 3840/2816/1536; 20 all-reduces per step, 4 per layer, the
embedding's, the final norm's gradient's and the loss's two; 2 CPU cores shared with a CI job):
the loss's two statistics all-reduces merged into one (19 per step) 0.98x the step through the
hub and 1.08x by the ring; each block's weight-gradient products run during its backward
all-reduce (gloo's async all-reduce; Megatron's overlap) 1.01x and 1.04x; bfloat16 payloads summed
in float32 0.99x and 1.06x, losses off by up to 1.1e-5 relative over 12-14 steps. The
collectives cost ~25 ms each on the 0.25 device whatever their size, and the same throttled
core computes and moves the bytes: fewer bytes or hidden products do not shorten its wait.

Kept: the hub over its own sockets instead of gloo's messages (2026-12-07, a quiet machine, 14 steps,
the default split by speed): the step 0.884x and 0.893x gloo's hub at speeds 1, 0.5, 0.25 (two runs;
the hub's seconds in all-reduces per step 0.299 -> 0.232 and 0.309 -> 0.241), 0.896x at 0.65, 0.52,
0.43, 0.947x at three 0.58 devices; the losses the same to the bit. gloo's ring: 1.07-1.16x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from edge_node.cpu_quota import CgroupQuota, cgroup_quota_available, pack_cores
from edge_node.worker_process import free_port

DEFAULT_VARIANTS = {"gloo-hub": {"hub": 0}, "socket-hub": {"hub": 0, "star": True}, "ring": {"hub": None}}

CHILD = """
import json, statistics, sys, time, torch, torch.distributed as dist
from edge_node.cpu_quota import join_quota
from edge_node.model_io import load_shard
from edge_node.optimizer import adamw
from edge_node.tp.comm import open_star
from edge_node.tp.context import TPContext
from edge_node.tp.cross_entropy import causal_lm_loss
from edge_node.tp.shared_groups import sum_shared_grads
from edge_node.worker import exit_now
from edge_node.model_io import full_param_shapes, load_config
from xronos.contract.splits import ModelDims, ShardSplit
rank, world, port, steps, warmup, batch, seq = (int(a) for a in sys.argv[1:8])
model_dir, split_json, variants_json, quota = sys.argv[8:12]
torch.set_num_threads(1)
join_quota(quota)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
config = load_config(model_dir)
dims, shapes = ModelDims.from_config(config), full_param_shapes(config)
split = ShardSplit.model_validate_json(split_json).check(dims)
vocab_start = split.interval("vocab_rows", rank)[0]
runs = {}
for name, attrs in json.loads(variants_json).items():
    tp = TPContext()
    for key, value in attrs.items():
        if key == "star":  # the hub's own sockets (built collectively), centred on the variant's hub
            tp.star = open_star(attrs["hub"], "127.0.0.1", 120.0) if value else None
            assert tp.star is not None or not value, "the hub's sockets could not be opened"
        else:
            setattr(tp, key, value)
    model = load_shard(model_dir, split, rank, tp)
    runs[name] = (tp, model, adamw(model.parameters(), 1e-4), {"wall": [], "comm": [], "calls": [], "loss": []})
rows = torch.randint(0, dims.vocab_size, (steps, batch, seq), generator=torch.Generator().manual_seed(0))
for step in range(steps):
    for name, (tp, model, optimizer, out) in runs.items():
        dist.barrier()
        calls, comm, start = tp.clock.calls, tp.clock.seconds, time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=rows[step], use_cache=False).logits
        loss = causal_lm_loss(logits, rows[step], vocab_start, tp)
        loss.backward()
        tp.weight_grads.flush()
        sum_shared_grads(model, split, rank, shapes, dims, tp)
        optimizer.step()
        out["wall"].append(time.perf_counter() - start)
        out["comm"].append(tp.clock.seconds - comm)
        out["calls"].append(tp.clock.calls - calls)
        out["loss"].append(loss.item())
mine = {name: out for name, (_, _, _, out) in runs.items()}
gathered = [None] * world
dist.all_gather_object(gathered, mine)  # the benchmark's own ranks, on one machine
if rank == 0:
    print(json.dumps(gathered), flush=True)
for tp, *_ in runs.values():
    if tp.star is not None:
        tp.star.close()
dist.barrier()  # every rank done with the store before rank 0's goes
dist.destroy_process_group()
exit_now(0)  # as a job's workers exit: an interpreter's teardown once ended a rank in std::terminate
"""


def summarise(gathered: list[dict], warmup: int) -> None:
    names = list(gathered[0])
    base = None
    print(
        f"{'variant':<10} {'step s':>7} {'/ first':>7} {'all-reduces':>11}  {'comm s per rank':<24} max rel loss diff"
    )
    for name in names:
        per_rank = [g[name] for g in gathered]
        steps = range(warmup, len(per_rank[0]["wall"]))
        walls = sorted(max(r["wall"][k] for r in per_rank) for k in steps)
        median = walls[len(walls) // 2]
        comm = [sum(r["comm"][k] for k in steps) / len(steps) for r in per_rank]
        losses = per_rank[0]["loss"]
        if base is None:
            base = (median, losses)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, base[1]))
        calls = sorted({c for r in per_rank for c in r["calls"][warmup:]})
        print(
            f"{name:<10} {median:>7.3f} {median / base[0]:>7.3f} {str(calls):>11}  "
            f"{' '.join(f'{c:.3f}' for c in comm):<24} {diff:.2e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speeds", default="1,0.5,0.25", help="cores per rank; rank 0 first")
    parser.add_argument("--split", help="a ShardSplit as JSON (default: the toy model's by speed)")
    parser.add_argument("--variants", default=json.dumps(DEFAULT_VARIANTS), help="name -> TPContext attributes")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if not cgroup_quota_available():
        sys.exit("comm_bench: error: needs a writable cgroup v1 cpu controller (root)")
    from edge_node.toy_model import make_model
    from xronos.contract.splits import ModelDims
    from xronos.planner.planning import split_for_mode

    speeds = [float(s) for s in args.speeds.split(",")]
    cpus = pack_cores(speeds, len(os.sched_getaffinity(0)))
    port, run = free_port(), uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory(prefix="xronos-comm-") as tmp:
        shape = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536, vocab=8192)
        model = make_model(
            Path(tmp) / "model", hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1536, vocab=8192
        )
        from edge_node.model_io import load_config

        dims = ModelDims.from_config(load_config(model))
        split = args.split or split_for_mode("xronos", dims, len(speeds), speeds).model_dump_json()
        print(f"model {shape}, batch {args.batch_size} x {args.seq_len}, speeds {speeds}, split {split}", flush=True)
        quotas, procs = [], []
        try:
            for rank, speed in enumerate(speeds):
                quotas.append(CgroupQuota(f"xronos-comm-{run}-{rank}", speed))
                command = [sys.executable, "-c", CHILD, str(rank), str(len(speeds)), str(port), str(args.steps)]
                command += [str(args.warmup), str(args.batch_size), str(args.seq_len), str(model), split]
                command += [args.variants, quotas[-1].procs_file]
                pin = (lambda c=cpus[rank]: os.sched_setaffinity(0, c)) if cpus else None
                procs.append(subprocess.Popen(command, preexec_fn=pin, stdout=subprocess.PIPE, text=True))
            outputs = [p.communicate()[0] for p in procs]
            if any(p.returncode for p in procs):
                sys.exit("comm_bench: error: a rank failed (see above)")
        finally:
            for p in procs:
                p.kill()
            for quota in quotas:
                quota.close()
    summarise(json.loads(outputs[0].strip().splitlines()[-1]), args.warmup)


if __name__ == "__main__":
    main()
