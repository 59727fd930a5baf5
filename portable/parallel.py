"""Plan presets: the sharding rules of the standard tensor-parallel layers.

Each preset takes a regex over module paths (`r"blocks\\.\\d+\\.mlp\\.fc"`) and returns the
`ShardingRule`s for that module's parameters. An nn.Linear stores `weight` as [out, in];
`transposed=True` is for layers that store it as [in, out] (Hugging Face's `Conv1D` in GPT-2):

- `column_parallel`: weight split on its output features (dim 0, or 1 when transposed), bias
  split; the output is split on its last dim, so an activation needs no communication.
- `row_parallel`: weight split on its input features (dim 1, or 0 when transposed), bias
  replicated; the output is a partial sum, reduced once (all-reduce, or reduce-scatter under
  sequence parallelism).
- `vocab_parallel`: an embedding table split on dim 0 (the vocabulary).
- `head_parallel`: an attention block's q/k/v projections column-parallel and its output
  projection row-parallel, with the head count checked against the axis size.

Optimizer state follows its parameter; FSDP and batch sharding are `Plan` fields.
"""

from __future__ import annotations

from .errors import PlanError
from .ir.plan import Experts, Mesh, PartitionSpec, Pipeline, Plan, ShardingRule

__all__ = [
    "Experts",
    "Mesh",
    "PartitionSpec",
    "Pipeline",
    "Plan",
    "ShardingRule",
    "column_parallel",
    "head_parallel",
    "row_parallel",
    "vocab_parallel",
]


def _weight_spec(axis: str, features: str, transposed: bool) -> PartitionSpec:
    """The weight spec splitting its `features` ("out" or "in") dim over `axis`."""
    out_first = (features == "out") != transposed
    return PartitionSpec(axis, None) if out_first else PartitionSpec(None, axis)


def column_parallel(
    module: str, axis: str = "tp", *, bias: bool = True, transposed: bool = False
) -> list[ShardingRule]:
    rules = [ShardingRule(rf"{module}\.weight", _weight_spec(axis, "out", transposed))]
    if bias:
        rules.append(ShardingRule(rf"{module}\.bias", PartitionSpec(axis)))
    return rules


def row_parallel(module: str, axis: str = "tp", *, transposed: bool = False) -> list[ShardingRule]:
    return [ShardingRule(rf"{module}\.weight", _weight_spec(axis, "in", transposed))]


def vocab_parallel(module: str, axis: str = "tp") -> list[ShardingRule]:
    return [ShardingRule(rf"{module}\.weight", PartitionSpec(axis, None))]


def head_parallel(
    module: str,
    *,
    heads: int,
    axis_size: int,
    axis: str = "tp",
    q: str = "q_proj",
    k: str = "k_proj",
    v: str = "v_proj",
    o: str = "o_proj",
    kv_heads: int | None = None,
    bias: bool = False,
) -> list[ShardingRule]:
    """Rules for attention at `module` with `heads` query heads (and `kv_heads` for GQA) split
    over `axis` of size `axis_size`; each rank computes heads/axis_size heads end to end.

    q, k and v must be separate projections: a fused one (GPT-2's `c_attn` computes [q | k | v]
    in one output) split contiguously would give a rank a mix of q and k features, not whole
    heads, so naming one module twice is a PlanError."""
    if len({q, k, v}) < 3:
        raise PlanError(
            f"head_parallel needs separate q, k, v projections; got q={q!r}, k={k!r}, v={v!r} "
            "(a fused qkv projection split contiguously does not give each rank whole heads)",
            fix="make the fused projection column_parallel (transposed=True for a Conv1D) and "
            "its output projection row_parallel: attention then runs on full heads (correct, "
            "not head-parallel)",
        )
    for name, count in (("heads", heads), ("kv_heads", kv_heads)):
        if count is not None and count % axis_size:
            raise PlanError(
                f"{axis}={axis_size} does not divide {name}={count}: "
                f"{count} % {axis_size} = {count % axis_size}",
                fix=f"use a {axis} size that divides {count}",
            )
    rules = []
    for proj in (q, k, v):
        rules += column_parallel(rf"{module}\.{proj}", axis, bias=bias)
    rules += row_parallel(rf"{module}\.{o}", axis)
    return rules
