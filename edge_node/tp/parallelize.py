"""`parallelize`: turn a Hugging Face Llama-family model into one rank's shard of it.

Order matters and mirrors the model's data flow:
1. vocabulary-parallel embedding (its output is summed across ranks);
2. per decoder layer: copy_to_tp after each norm (the replicated input of the
   attention and MLP blocks), column-parallel q/k/v and gate/up, row-parallel
   o and down; a rank with no KV group gets `HeadlessAttention`, a rank with
   some rows of a shared group gets `share_rows`;
3. copy_to_tp after the final norm, then the vocabulary-parallel LM head
   (tied to the embedding shard when the model ties them; some of its rows'
   weight gradients spread over the layers' attention backward waits where
   the split says so).
The model's own forward code is untouched. Works on a meta-device model, so
nothing full-sized is ever allocated.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from edge_node.tp.context import TPContext
from edge_node.tp.layers import HeadlessAttention, RowParallelLinear, VocabParallelEmbedding, share_rows
from edge_node.tp.mappings import copy_to_tp
from edge_node.tp.plan import LAYER_PLAN, ColumnParallel, param_slice, split_dim
from edge_node.tp.weight_grads import RowsWeightGradLaterLinear, WeightGradLaterLinear
from xronos.contract.errors import XronosError
from xronos.contract.profiles import SEGMENT_FIELDS
from xronos.contract.splits import ModelDims, ShardSplit

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def check_supported(config) -> None:
    """Refuse architectures whose layout the plan does not describe."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise XronosError(
            f"unsupported architecture {model_type!r}: Xronos shards {', '.join(SUPPORTED_MODEL_TYPES)} "
            "models (q/k/v/o attention and gate/up/down MLP)"
        )


def _copy_output_to_tp(tp: TPContext, closes: str):
    """A forward hook feeding a norm's output to a parallel block (segment `closes`: its backward ends there)."""
    return lambda module, inputs, output: copy_to_tp(output, tp, closes)


def _sharded(
    linear: nn.Linear, name: str, style, split: ShardSplit, rank: int, dims: ModelDims, tp: TPContext
) -> nn.Module:
    """A shard-sized replacement for `linear` (parameters on the same device, uninitialised)."""
    part = param_slice(f"{name}.weight", split, rank, dims)
    if part is None:
        raise ValueError(f"{name} is not split: LAYER_PLAN and param_slice disagree")
    device = linear.weight.device
    has_bias = linear.bias is not None
    dim = split_dim(style.unit)
    later = split.rank_computes_weight_grads_later(dim, rank)
    if isinstance(style, ColumnParallel):
        if later:
            return WeightGradLaterLinear(linear.in_features, part.size, tp.weight_grads, bias=has_bias, device=device)
        return nn.Linear(linear.in_features, part.size, bias=has_bias, device=device)
    row = RowParallelLinear(part.size, linear.out_features, bias=has_bias, tp=tp, device=device)
    row.weight_grad_later, row.closes = later, dim
    return row


HFCausalLM = Any
"""A transformers *ForCausalLM (Llama layout). Typed Any: nn.Module's `__getattr__` types each
submodule as `Tensor | Module`, which no attribute chain of a Hugging Face model survives."""


def parallelize(model: HFCausalLM, split: ShardSplit, rank: int, tp: TPContext) -> nn.Module:
    """Swap in rank `rank`'s shards of every parallel module, in place, all sharing `tp` (whose
    holders become the split's); returns the model."""
    check_supported(model.config)
    dims = ModelDims.from_config(model.config)
    split.check(dims)
    tp.holders = {dim: split.holders(dim) for dim in SEGMENT_FIELDS}
    base = model.model

    lo, hi = split.interval("vocab_rows", rank)
    device = base.embed_tokens.weight.device
    base.embed_tokens = VocabParallelEmbedding(lo, hi - lo, dims.hidden_size, model.config.pad_token_id, tp, device)

    rows = split.attention_shares()[rank][1]
    for i, layer in enumerate(base.layers):
        prefix = f"model.layers.{i}"
        layer.input_layernorm.register_forward_hook(_copy_output_to_tp(tp, "kv_groups"))
        layer.post_attention_layernorm.register_forward_hook(_copy_output_to_tp(tp, "mlp_columns"))
        for suffix, style in LAYER_PLAN.items():
            parent_path, _, attr = suffix.rpartition(".")
            parent = layer.get_submodule(parent_path)
            setattr(parent, attr, _sharded(getattr(parent, attr), f"{prefix}.{suffix}", style, split, rank, dims, tp))
        if split.kv_groups[rank] == 0:
            layer.self_attn = HeadlessAttention(layer.self_attn.o_proj)
        elif rows is not None:
            assert split.micro_batch_rows is not None  # rows of a shared group come with it
            share_rows(layer.self_attn, rows, split.micro_batch_rows)

    base.norm.register_forward_hook(_copy_output_to_tp(tp, "vocab_rows"))
    later = split.vocab_later(rank)
    model.lm_head = (
        RowsWeightGradLaterLinear(dims.hidden_size, hi - lo, later, dims.num_layers, tp.weight_grads, device=device)
        if later
        else nn.Linear(dims.hidden_size, hi - lo, bias=False, device=device)
    )
    tie_vocab_shards(model)
    return model


def tie_vocab_shards(model: HFCausalLM) -> None:
    """Share the embedding shard with the LM head when the model ties them.

    Call again after `to_empty`/`to`, which give each module its own new parameter.
    """
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
