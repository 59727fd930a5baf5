"""Plan presets: the sharding rules of the standard tensor-parallel layers.

Each preset takes a regex over module paths (`r"blocks\\.\\d+\\.mlp\\.fc"`) and returns the
`ShardingRule`s for that module's parameters (an nn.Linear stores `weight` as [out, in]):

- `column_parallel`: weight split on dim 0 (output features), bias split; the output is split
  on its last dim, so an activation needs no communication.
- `row_parallel`: weight split on dim 1 (input features), bias replicated; the output is a partial
  sum, reduced once (all-reduce, or reduce-scatter under sequence parallelism).
- `vocab_parallel`: an embedding table split on dim 0 (the vocabulary).
- `head_parallel`: an attention block's q/k/v projections column-parallel and its output
  projection row-parallel, with the head count checked against the axis size.

Optimizer state follows its parameter; FSDP and batch sharding are `Plan` fields.
"""

from __future__ import annotations

from .errors import PlanError
from .ir.plan import Mesh, PartitionSpec, Plan, ShardingRule

__all__ = [
    "Mesh",
    "PartitionSpec",
    "Plan",
    "ShardingRule",
    "column_parallel",
    "head_parallel",
    "row_parallel",
    "vocab_parallel",
]


def column_parallel(module: str, axis: str = "tp", *, bias: bool = True) -> list[ShardingRule]:
    rules = [ShardingRule(rf"{module}\.weight", PartitionSpec(axis, None))]
    if bias:
        rules.append(ShardingRule(rf"{module}\.bias", PartitionSpec(axis)))
    return rules


def row_parallel(module: str, axis: str = "tp") -> list[ShardingRule]:
    return [ShardingRule(rf"{module}\.weight", PartitionSpec(None, axis))]


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
    over `axis` of size `axis_size`; each rank computes heads/axis_size heads end to end."""
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
