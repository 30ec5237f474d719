"""The bench's reference `hf-tp`: transformers' own tensor parallelism trains the rows single mode does.

Real worker processes under CPU quotas, real gloo, transformers' `tp_plan="auto"` DTensors.
"""

from __future__ import annotations

import pytest

from edge_node.hf_tp import check_plan, hf_split, shard_sizes
from tests.conftest import SEQ_LEN
from xronos.bench import BenchResult, loss_difference
from xronos.cli import main
from xronos.contract.errors import XronosError
from xronos.contract.job import JobOptions
from xronos.contract.splits import ModelDims

LOSS_RTOL = 1e-5
"""hf-tp computes single mode's arithmetic with the heads, MLP columns and vocabulary cut over ranks and
summed by all-reduces: only float32 summation order differs (measured: ~4e-8 relative over 5 steps).
A real difference (a batch out of order, a gradient not reduced, other AdamW settings) moves the
losses of the second step on by 1e-3 or more."""


def bench_args(model, data, out, modes: str, nodes: int = 2) -> list[str]:
    return [
        "bench",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(out),
        "--batch-size",
        "4",
        "--grad-accum",
        "2",
        "--seq-len",
        str(SEQ_LEN),
        "--steps",
        "4",
        "--lr",
        "2e-3",
        "--nodes",
        str(nodes),
        "--speeds",
        ",".join(["1", "0.5", "0.25"][:nodes]),
        "--modes",
        modes,
        "--quiet",
    ]


def test_hf_tp_trains_the_rows_single_mode_does(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert (
        main([*bench_args(model_dir("mha_untied"), data_file, tmp_path / "b", "single,hf-tp"), "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    result = BenchResult.model_validate_json(out.read_text())
    hf, single = result.reports["hf-tp"], result.reports["single"]
    assert hf.mode == "hf-tp" and hf.world_size == 2 and [n.speed for n in hf.nodes] == [1.0, 0.5]
    assert len(hf.losses) == 4 and hf.losses[-1] < hf.losses[0]
    assert loss_difference(hf.losses, single.losses) < LOSS_RTOL
    row = next(line for line in printed.splitlines() if line.startswith("hf-tp "))
    assert " - " in row and "tp_plan auto: kv 4/4" in row  # idle not measured; its even split
    assert "hf-tp losses vs single, step by step: max relative difference" in printed


def test_hf_tp_refuses_heads_its_plan_cannot_split(model_dir, data_file, tmp_path, capsys):
    """gqa_tied has 6 heads and 3 KV heads: transformers' plan cannot cut 3 over 2 devices."""
    code = main(bench_args(model_dir("gqa_tied"), data_file, tmp_path, "hf-tp"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "xronos: error: hf-tp cannot run: transformers' tp_plan splits attention heads evenly: "
        "6 heads and 3 KV heads do not divide over 2 devices"
    ]


def test_bench_refuses_an_unknown_mode(model_dir, data_file, tmp_path, capsys):
    code = main(bench_args(model_dir("mha_untied"), data_file, tmp_path, "tp,hf_tp"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        "xronos: error: unknown mode 'hf_tp' in --modes (choose from single, tp, xronos, pp, hf-tp)"
    ]


def test_hf_tp_split_is_dtensors_chunks(model_dir):
    from edge_node.model_io import load_config

    assert shard_sizes(322, 3) == [108, 108, 106] and shard_sizes(5, 4) == [2, 2, 1, 0]
    dims = ModelDims.from_config(load_config(model_dir("mha_untied")))
    split = hf_split(dims, 2)
    assert split.kv_groups == [4, 4] and split.mlp_columns == [96, 96] and split.vocab_rows == [160, 160]
    job = JobOptions(model=str(model_dir("mha_untied")), data="rows.jsonl", output="out", lora={"r": 4})
    with pytest.raises(XronosError, match="leave out --lora"):
        check_plan(job, dims, 2)
