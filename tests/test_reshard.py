"""Re-sharding in memory (`edge_node.reshard`): each rank ends with exactly what loading the new split gives.

The move arithmetic is checked against element-by-element bookkeeping on many splits; the
transfer itself by real processes passing real slices over gloo, through a chain of splits
with empty shares, KV groups shared by rows, and a tied vocabulary.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from edge_node.model_io import SafetensorsReader, full_param_shapes, load_config, load_shard
from edge_node.reshard import moves, reshard_tensors
from edge_node.tp.context import TPContext
from edge_node.tp.plan import Slice, param_slice
from edge_node.worker_process import free_port
from xronos.contract.splits import ModelDims, ShardSplit


def _tiling(total: int, ranks: int, rng: random.Random) -> list[Slice]:
    """Random intervals in rank order covering [0, total), some empty, neighbours sometimes sharing one unit."""
    cuts = sorted(rng.randint(0, total) for _ in range(ranks - 1))
    bounds = [0, *cuts, total]
    parts = [[lo, hi] for lo, hi in zip(bounds, bounds[1:])]
    for r in range(1, ranks):  # a shared group: rank r also holds the last unit of a non-empty rank r-1
        if parts[r - 1][1] > parts[r - 1][0] and parts[r][0] == parts[r - 1][1] and rng.random() < 0.3:
            parts[r][0] -= 1
    return [Slice(0, lo, hi) for lo, hi in parts]


def test_moves_deliver_every_new_element_once_from_a_rank_that_held_it():
    rng = random.Random(0)
    for _ in range(2000):
        ranks, total = rng.randint(1, 5), rng.randint(1, 12)
        old, new = _tiling(total, ranks, rng), _tiling(total, ranks, rng)
        got = [[0] * total for _ in range(ranks)]
        for m in moves(old, new):
            assert old[m.src].start <= m.start < m.stop <= old[m.src].stop  # the source holds it
            for e in range(m.start, m.stop):
                got[m.dst][e] += 1
        for dst, want in enumerate(new):
            assert got[dst] == [int(want.start <= e < want.stop) for e in range(total)], (old, new, dst)


SPLITS = {
    "mha_untied": [
        dict(kv_groups=[3, 3, 2], mlp_columns=[64, 64, 64], vocab_rows=[100, 100, 120]),
        dict(
            kv_groups=[7, 1, 1],
            kv_rows=[None, (0, 3), (3, 4)],
            mlp_columns=[192, 0, 0],
            vocab_rows=[0, 300, 20],
            weight_grads_later=[False, True, False],
            vocab_rows_later=[0, 50, 0],
        ),
        dict(kv_groups=[0, 5, 3], mlp_columns=[12, 60, 120], vocab_rows=[320, 0, 0]),
        dict(kv_groups=[3, 3, 2], mlp_columns=[64, 64, 64], vocab_rows=[100, 100, 120]),
    ],
    "gqa_tied": [
        dict(kv_groups=[2, 1, 0], mlp_columns=[0, 64, 96], vocab_rows=[200, 90, 30]),
        dict(
            kv_groups=[2, 1, 1],
            kv_rows=[None, (0, 3), (3, 4)],
            mlp_columns=[96, 32, 32],
            vocab_rows=[160, 100, 60],
            attention_weight_grads_later=[True, False, True],
        ),
        dict(kv_groups=[1, 1, 1], mlp_columns=[160, 0, 0], vocab_rows=[1, 300, 19]),
    ],
}


def _moment(full: torch.Tensor, k: int) -> torch.Tensor:
    """A full-sized stand-in for AdamW moment k, distinct from the parameter and from each other."""
    return full * (k + 2) + k


def _ranks(rank: int, world: int, port: int, directory: str, splits: list[dict], results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = load_config(directory)
        dims, shapes = ModelDims.from_config(config), full_param_shapes(config)
        reader = SafetensorsReader(directory)
        full = {name: reader.read(name) for name in shapes}
        mine = lambda name, split: param_slice(name, split, rank, dims)  # noqa: E731

        def part(tensor, name, split):
            s = mine(name, split)
            return tensor if s is None else tensor.narrow(s.dim, s.start, s.size)

        split = ShardSplit(**splits[0])
        held = {
            name: [p.detach(), *(part(_moment(full[name], k), name, split) for k in range(2))]
            for name, p in load_shard(directory, split, rank, TPContext()).named_parameters()
        }
        checks = []
        for nxt in splits[1:]:
            new = ShardSplit(**nxt)
            held = reshard_tensors(
                held,
                shapes,
                lambda n, r, s=split: param_slice(n, s, r, dims),
                lambda n, r, s=new: param_slice(n, s, r, dims),
                rank,
                world,
            )
            loaded = dict(load_shard(directory, new, rank, TPContext()).named_parameters())
            for name, param in loaded.items():
                value, *state = held[name]
                checks.append(
                    torch.equal(value, param.detach())
                    and all(torch.equal(m, part(_moment(full[name], k), name, new)) for k, m in enumerate(state))
                )
            # what the new model has no parameter for (a rank without a KV group has no q, k or v) is empty
            checks += [all(t.numel() == 0 for t in held[name]) for name in held.keys() - loaded.keys()]
            split = new
        results[rank] = (len(checks), all(checks))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_reshard_in_memory_equals_loading_the_new_split(name, model_dir):
    results = mp.Manager().dict()
    mp.spawn(_ranks, args=(3, free_port(), str(model_dir(name)), SPLITS[name], results), nprocs=3)
    for rank in range(3):
        count, ok = results[rank]
        assert count > 0 and ok, f"rank {rank}"
