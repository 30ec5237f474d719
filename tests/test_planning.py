"""Pure split arithmetic: sums, proportions, slices, and the errors users see; the checkpoint interval."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge_node.tp.plan import Slice, param_slice
from xronos.contract.errors import XronosError
from xronos.contract.job import MAX_EVERY, JobOptions
from xronos.contract.splits import ModelDims, ShardSplit
from xronos.planner.checkpoint_plan import CHECKPOINT_SHARE, checkpoint_interval, checkpoint_seconds
from xronos.planner.cost_model import parameter_count
from xronos.planner.job_plan import JobPlan
from xronos.planner.planning import even_split, split_for_mode, split_units, weighted_split

DIMS = ModelDims(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
)


@given(
    total=st.integers(0, 5000),
    weights=st.lists(st.floats(0.01, 10), min_size=1, max_size=12),
    block=st.sampled_from([1, 8, 64]),
)
def test_split_units_sums_and_is_near_proportional(total, weights, block):
    parts = split_units(total, weights, block)
    assert sum(parts) == total and len(parts) == len(weights)
    blocks = total // block
    for part, w in zip(parts, weights):
        ideal = w / sum(weights) * blocks
        assert abs(part // block - ideal) <= 1 + (total % block > 0)


def test_even_and_speed_splits():
    assert even_split(DIMS, 3).kv_groups == [1, 1, 1]
    assert even_split(DIMS, 2).kv_groups == [2, 1]
    fast = weighted_split(DIMS, [1, 0.5, 0.25])
    assert fast.mlp_columns[0] > fast.mlp_columns[1] > fast.mlp_columns[2]
    assert all(c % DIMS.mlp_block == 0 for c in fast.mlp_columns) and DIMS.mlp_block == 64
    assert split_for_mode("single", DIMS, 3, None).world_size == 1


def test_split_that_does_not_sum_names_the_dimension():
    with pytest.raises(XronosError, match=r"kv_groups 2\+2=4 does not sum to the model's 3"):
        ShardSplit(kv_groups=[2, 2], mlp_columns=[1536, 0], vocab_rows=[49152, 0]).check(DIMS)
    with pytest.raises(ValueError, match="one entry per rank"):
        ShardSplit(kv_groups=[3], mlp_columns=[1536, 0], vocab_rows=[49152, 0])


def test_param_slices_follow_groups_and_units():
    split = ShardSplit(kv_groups=[2, 0, 1], mlp_columns=[1000, 536, 0], vocab_rows=[0, 100, 49052])
    q = "model.layers.7.self_attn.q_proj.weight"
    assert param_slice(q, split, 0, DIMS) == Slice(0, 0, 2 * 3 * 64)  # 2 groups of 3 query heads
    assert param_slice(q, split, 2, DIMS) == Slice(0, 384, 576)
    assert param_slice("model.layers.0.self_attn.k_proj.bias", split, 2, DIMS) == Slice(0, 128, 192)
    assert param_slice("model.layers.0.self_attn.o_proj.weight", split, 1, DIMS).size == 0
    assert param_slice("model.layers.0.mlp.down_proj.weight", split, 1, DIMS) == Slice(1, 1000, 1536)
    assert param_slice("model.layers.0.mlp.down_proj.bias", split, 1, DIMS) is None
    assert param_slice("lm_head.weight", split, 2, DIMS) == Slice(0, 100, 49152)
    assert param_slice("model.norm.weight", split, 0, DIMS) is None
    assert param_slice("model.layers.3.input_layernorm.weight", split, 0, DIMS) is None


def test_holders_are_the_ranks_with_some_of_a_dimension():
    split = ShardSplit(kv_groups=[2, 0, 1], mlp_columns=[1000, 536, 0], vocab_rows=[0, 100, 49052])
    assert (split.holders("kv_groups"), split.holders("mlp_columns"), split.holders("vocab_rows")) == (
        (0, 2),
        (0, 1),
        (1, 2),
    )
    shared = ShardSplit(
        kv_groups=[2, 1, 1, 0],
        kv_rows=[None, (0, 3), (3, 4), None],
        mlp_columns=[1536, 0, 0, 0],
        vocab_rows=[49152, 0, 0, 0],
    )
    assert shared.holders("kv_groups") == (0, 1, 2)  # rows of a shared group are a share


def _plan(step_seconds: float | None, world: int = 3) -> JobPlan:
    return JobPlan(ranks=list(range(world)), reasons=[None] * world, predicted_step_seconds=step_seconds)


def test_checkpoint_interval_grows_with_the_model_and_shrinks_with_the_step():
    job = JobOptions(model="m", data="d", output="o", steps=1000)
    small = DIMS.model_copy(update={"num_layers": 4})
    assert checkpoint_interval(job, DIMS, _plan(10.0)) > checkpoint_interval(job, small, _plan(10.0))
    assert checkpoint_interval(job, DIMS, _plan(60.0)) < checkpoint_interval(job, DIMS, _plan(10.0))
    # about CHECKPOINT_SHARE of the time: one checkpoint per interval of predicted steps
    every = checkpoint_interval(job, DIMS, _plan(10.0))
    assert checkpoint_seconds(DIMS, 3) / (every * 10.0) == pytest.approx(CHECKPOINT_SHARE, rel=0.05)
    # one device moves nothing over the network: it checkpoints more often
    assert checkpoint_interval(job, DIMS, _plan(10.0, world=1)) < every


@given(step=st.floats(1e-300, 1e9), layers=st.integers(1, 200))
def test_checkpoint_interval_is_at_least_one_and_at_most_what_a_job_admits(step, layers):
    job = JobOptions(model="m", data="d", output="o", steps=10)
    every = checkpoint_interval(job, DIMS.model_copy(update={"num_layers": layers}), _plan(step))
    assert 1 <= every <= MAX_EVERY
    assert JobOptions(model="m", data="d", output="o", checkpoint_every=every).checkpoint_every == every
    assert checkpoint_interval(job, DIMS, _plan(None)) == 5  # no prediction: once, halfway


def test_parameter_count_is_the_models():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    for tied in (True, False):
        config = LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            tie_word_embeddings=tied,
        )
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert parameter_count(ModelDims.from_config(config)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj"), ("o_proj", "down_proj", "up_proj")])
def test_a_lora_checkpoint_counts_the_factors_peft_trains(targets):
    """The checkpoint interval of a LoRA job is sized by its adapter, as many parameters as peft trains."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from xronos.contract.lora import LoraOptions
    from xronos.planner.cost_model import trained_count

    config = LlamaConfig(
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=160,
        num_hidden_layers=2,
        vocab_size=320,
        tie_word_embeddings=True,
    )
    lora = LoraOptions(r=4) if targets is None else LoraOptions(r=4, targets=targets)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=list(lora.targets)))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    dims = ModelDims.from_config(config)
    assert trained_count(dims, lora) == trained < trained_count(dims)
