"""LoRA under uneven tensor parallelism equals single-process peft LoRA training.

Each case starts peft (`get_peft_model`) and the engine (`apply_lora` on real shards in real
gloo processes) from the same adapter, B random so that A's gradients are not zero, and trains
both with AdamW over the same batches: the losses, the trained factors, the exported adapter
(loaded by peft on the base model) and the merged model (loaded by plain transformers) agree to
float32 round-off, and no base weight moves or has optimizer state. Splits are uneven, with a
rank that holds no KV group (as rank 0, too: the replicated factors it gathers are placeholders'),
no MLP column, a KV group shared by rows, and the `*_later` layers of the split.

One spawn of three processes runs every case (a two-rank case leaves the third idle), so the
imports are paid once.
"""

from __future__ import annotations

import datetime
import json
import resource
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from edge_node.lora_io import ADAPTER_CONFIG, ADAPTER_STEM, load_adapter, peft_key, save_adapter, save_merged
from edge_node.model_io import ATTN_IMPLEMENTATION, full_param_shapes, load_config, load_shard
from edge_node.optimizer import adamw
from edge_node.tp.context import TPContext
from edge_node.tp.cross_entropy import causal_lm_loss
from edge_node.tp.lora import apply_lora, init_lora, lora_parameters, lora_shapes, lora_slice, sum_lora_grads
from tests.conftest import SEQ_LEN
from xronos.contract.lora import LoraOptions
from xronos.contract.splits import ModelDims, ShardSplit

STEPS, BATCH, LR = 4, 4, 1e-2


@dataclass(frozen=True)
class Case:
    model: str
    split: dict
    lora: dict
    accum: int = 1
    ranks: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "ranks", len(self.split["kv_groups"]))

    @property
    def options(self) -> LoraOptions:
        return LoraOptions(**self.lora)

    @property
    def id(self) -> str:
        targets = "all" if "targets" not in self.lora else "+".join(t.split("_")[0] for t in self.lora["targets"])
        return f"{self.model}-{self.ranks}r-kv{'/'.join(map(str, self.split['kv_groups']))}-r{self.lora['r']}-{targets}"


CASES = [
    Case("mha_untied", dict(kv_groups=[5, 3], mlp_columns=[120, 72], vocab_rows=[200, 120]), dict(r=4, alpha=8)),
    # rank 2 holds no KV group and only q, v are adapted (its attention's output is made to need a
    # gradient, as on the others); every rank's split has layers whose weight gradients came later
    Case(
        "gqa_tied",
        dict(
            kv_groups=[2, 1, 0],
            mlp_columns=[0, 64, 96],
            vocab_rows=[200, 90, 30],
            weight_grads_later=[False, True, True],
            attention_weight_grads_later=[True, False, True],
            vocab_rows_later=[0, 50, 30],
        ),
        dict(r=4, alpha=16, targets=("q_proj", "v_proj")),
    ),
    # a KV group shared by rows (q/k/v biases), a rank with no MLP column, two micro-batches a step
    Case(
        "qwen2_gqa",
        dict(kv_groups=[1, 1, 1], kv_rows=[(0, 1), (1, 2), None], mlp_columns=[64, 0, 64], vocab_rows=[100, 120, 100]),
        dict(r=2),
        accum=2,
    ),
    # rank 0 holds no KV group: the q and k factors it gathers from its own copy are placeholders'
    Case(
        "gqa_tied",
        dict(kv_groups=[0, 3], mlp_columns=[100, 60], vocab_rows=[30, 290]),
        dict(r=8, alpha=4, targets=("q_proj", "k_proj", "o_proj", "down_proj")),
    ),
]


def _rows(data_file) -> torch.Tensor:
    rows = [json.loads(line)["input_ids"][:SEQ_LEN] for line in Path(data_file).read_text().splitlines()]
    return torch.tensor(rows)


def _probe(rows: torch.Tensor, case: Case) -> torch.Tensor:
    """Rows no step trained on, one micro-batch (a split sharing rows computes no other size)."""
    return rows[-BATCH // case.accum :]


def _batches(rows: torch.Tensor, step: int, case: Case):
    return rows[step * BATCH : (step + 1) * BATCH].chunk(case.accum)


def _reference(case: Case, model_dir: Path, rows: torch.Tensor, init_dir: Path):
    """peft on one process: the initial adapter (saved to `init_dir`), then its training."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION)
    lora = case.options
    model = get_peft_model(
        base, LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0, target_modules=list(lora.targets))
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape) * 0.1)
    model.save_pretrained(init_dir)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(params, LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in _batches(rows, step, case):
            loss = model(input_ids=micro, labels=micro).loss / case.accum
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    trained = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return losses, trained


def _train_case(rank: int, case: Case, model_dir: str, rows: torch.Tensor, out: Path) -> dict:
    """One rank of the engine: shard, adapt, load the initial adapter, train, export."""
    config = load_config(model_dir)
    dims, shapes = ModelDims.from_config(config), full_param_shapes(config)
    lora, split, tp = case.options, ShardSplit(**case.split), TPContext()
    factor_shapes = lora_shapes(shapes, lora)
    model = apply_lora(load_shard(model_dir, split, rank, tp), lora)
    slice_of = lambda name, r: lora_slice(name, split, r, dims)  # noqa: E731
    load_adapter(model, out.parent / "init", lora, slice_of, rank)
    factors = lora_parameters(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if n not in factors}
    optimizer = adamw(factors.values(), LR)
    vocab_start = split.interval("vocab_rows", rank)[0]
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in _batches(rows, step, case):
            logits = model(input_ids=micro, use_cache=False).logits  # (B, T, V_local)
            loss = causal_lm_loss(logits, micro, vocab_start, tp) / case.accum
            loss.backward()
            tp.weight_grads.flush()
            total += loss.item()
        sum_lora_grads(model, split, rank, factor_shapes, dims, tp)
        optimizer.step()
        losses.append(total)

    params = dict(model.named_parameters())
    frozen = all(not params[n].requires_grad and params[n].grad is None for n in base)
    stepped = {id(p) for p in optimizer.state} == {id(p) for p in factors.values()}
    unchanged = all(torch.equal(params[n], value) for n, value in base.items())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_probe(rows, case), use_cache=False).logits
    save_adapter(out / "adapter", model, lora, model_dir, factor_shapes, slice_of, rank, split.world_size)
    save_merged(out / "merged", Path(model_dir), model, shapes, slice_of, rank, split.world_size)
    with torch.no_grad():
        merged_logits = model(input_ids=_probe(rows, case), use_cache=False).logits
    torch.save({"start": vocab_start, "logits": logits, "merged": merged_logits}, out / f"logits-{rank}.pt")
    return {
        "losses": losses,
        "frozen": frozen,
        "stepped_only_factors": stepped,
        "base_unchanged": unchanged,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def _ranks(rank: int, cases: list[Case], model_dirs: list[str], rows: torch.Tensor, root: str, results) -> None:
    torch.set_num_threads(1)
    for i, case in enumerate(cases):
        if rank >= case.ranks:
            continue
        out = Path(root) / f"case-{i}" / "engine"
        dist.init_process_group(
            "gloo",
            init_method=f"file://{root}/store-{i}",
            rank=rank,
            world_size=case.ranks,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            results[(i, rank)] = _train_case(rank, case, model_dirs[i], rows, out)
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(model_dir, data_file, tmp_path_factory):
    """Every case's peft reference (losses, trained adapter) and engine run (per-rank results)."""
    root = tmp_path_factory.mktemp("lora")
    rows = _rows(data_file)
    model_dirs = [str(model_dir(case.model)) for case in CASES]
    references = []
    for i, case in enumerate(CASES):
        (root / f"case-{i}" / "engine").mkdir(parents=True)
        references.append(_reference(case, Path(model_dirs[i]), rows, root / f"case-{i}" / "init"))
    results = mp.Manager().dict()
    mp.spawn(_ranks, args=(CASES, model_dirs, rows, str(root), results), nprocs=max(c.ranks for c in CASES))
    return root, rows, model_dirs, references, dict(results)


def _full_logits(out: Path, ranks: int, key: str) -> torch.Tensor:
    parts = [torch.load(out / f"logits-{r}.pt") for r in range(ranks)]
    return torch.cat([p[key] for p in sorted(parts, key=lambda p: p["start"])], dim=-1)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.id for c in CASES])
def test_lora_under_uneven_tp_equals_peft(index, runs):
    root, rows, model_dirs, references, results = runs
    case, (ref_losses, ref_trained) = CASES[index], references[index]
    out = root / f"case-{index}" / "engine"
    ranks = [results[(index, r)] for r in range(case.ranks)]

    # the same losses on every rank, and peft's
    for rank in ranks:
        assert rank["losses"] == ranks[0]["losses"]
        assert rank["frozen"] and rank["stepped_only_factors"] and rank["base_unchanged"]
    for step, (got, want) in enumerate(zip(ranks[0]["losses"], ref_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: {got} vs {want}"

    # the trained adapter, gathered and written as peft writes it, equals peft's trained one
    adapter = load_file(out / "adapter" / f"{ADAPTER_STEM}.safetensors")
    assert adapter.keys() == ref_trained.keys()
    initial = load_file(root / f"case-{index}" / "init" / f"{ADAPTER_STEM}.safetensors")
    for key, want in ref_trained.items():
        assert not torch.equal(want, initial[key]), f"{key} did not train"
        torch.testing.assert_close(adapter[key], want, rtol=0, atol=1e-5, msg=key)
    config = json.loads((out / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["r"] == case.options.r and config["lora_alpha"] == case.options.lora_alpha

    # peft loads it on the base model and computes the engine's logits; the merged model, plain transformers too
    engine_logits = _full_logits(out, case.ranks, "logits")
    torch.testing.assert_close(_full_logits(out, case.ranks, "merged"), engine_logits, rtol=1e-5, atol=1e-5)
    probe = _probe(rows, case)
    base = AutoModelForCausalLM.from_pretrained(
        model_dirs[index], dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    peft_model = PeftModel.from_pretrained(base, out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(
        out / "merged", dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=probe).logits, engine_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=probe).logits, engine_logits, rtol=1e-5, atol=1e-5)


def test_factor_slices_tile_the_full_factors_and_init_ignores_the_split(model_dir):
    """Every factor element is on some rank (once, or on every rank when replicated), and the
    initial adapter is the same whatever the split: no process group needed."""
    config = load_config(model_dir("gqa_tied"))
    dims, shapes = ModelDims.from_config(config), full_param_shapes(config)
    lora = LoraOptions(r=3, targets=("q_proj", "o_proj", "up_proj", "down_proj"))
    factor_shapes = lora_shapes(shapes, lora)
    assert len(factor_shapes) == 2 * 4 * dims.num_layers
    adapters = []
    for split in (
        ShardSplit(kv_groups=[3], mlp_columns=[160], vocab_rows=[320]),
        ShardSplit(kv_groups=[0, 2, 1], mlp_columns=[32, 0, 128], vocab_rows=[1, 300, 19]),
    ):
        full = {name: torch.full(shape, float("nan")) for name, shape in factor_shapes.items()}
        for rank in range(split.world_size):
            model = apply_lora(load_shard(model_dir("gqa_tied"), split, rank, TPContext()), lora)
            init_lora(model, factor_shapes, split, rank, dims, seed=5)
            assert all(not p.requires_grad for n, p in model.named_parameters() if n not in lora_parameters(model))
            for name, param in lora_parameters(model).items():
                part = lora_slice(name, split, rank, dims)
                target = full[name] if part is None else full[name].narrow(part.dim, part.start, part.size)
                assert target.shape == param.shape, name
                if part is None and rank:  # replicated: every rank's copy is the same
                    assert torch.equal(target, param.detach()), name
                target.copy_(param.detach())
        assert all(not t.isnan().any() for t in full.values())
        adapters.append(full)
    for name in factor_shapes:
        assert torch.equal(adapters[0][name], adapters[1][name]), name
        assert peft_key(name).startswith("base_model.model.model.layers.")
        if "lora_B" in name:
            assert not adapters[0][name].any()  # B starts at zero: the adapted model starts as the base


def test_lora_options_are_checked():
    assert LoraOptions(r=8).scaling == 1.0 and LoraOptions(r=8, alpha=32).scaling == 4.0
    with pytest.raises(ValueError, match="twice"):
        LoraOptions(r=2, targets=("q_proj", "q_proj"))
    with pytest.raises(ValueError):
        LoraOptions(r=2, targets=("lm_head",))
    with pytest.raises(ValueError):
        LoraOptions(r=0)


def test_a_frozen_matrix_held_in_bfloat16_computes_in_float32_and_keeps_only_itself_for_the_backward():
    """`frozen_linear` with a bfloat16 weight: the product and the input's gradient of F.linear on the
    weight upcast, in float32, with the bfloat16 weight (not a float32 copy) saved for the backward."""
    from edge_node.tp.frozen import frozen_linear

    weight = torch.randn(24, 16).to(torch.bfloat16)
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = frozen_linear(x, weight)
    y_ref = torch.nn.functional.linear(x_ref, weight.float())
    assert y.dtype == torch.float32 and torch.equal(y, y_ref)
    assert [t.dtype for t in saved] == [torch.bfloat16]
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-6)
