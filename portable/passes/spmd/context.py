"""Context parallelism (`Plan.context_axis`): the pieces of the pass that only it needs.

Under context parallelism every user input of two or more dims is split on dim 1 (the sequence)
over the context axis (`layouts.py`), and the ordinary rules carry that split through the model:
embeddings, norms, pointwise ops and the matmuls of linear layers run on this rank's tokens; the
flattening of tokens for a matmul keeps them where they are (`merges.py`); rotary tables, position
ids and masks built from sizes are sliced to this rank's positions (`localize.py`, whose
`local_shard` of an `arange` holds the rank's global positions); a mean loss over tokens is a
global sum over a global count. Attention keeps the queries local and gathers keys and values
over the axis (the all-gather form: rules/nn.py, and rules/linalg.py for attention written as
matmuls); their gradients are partial sums, reduce-scattered back onto the sequence.

This module holds what does not fit a per-op rule:

- `causal_masks`: `attention(..., is_causal=True)` masks key j for query i when j > i, with i
  the LOCAL row: on a rank holding queries from offset o that is the wrong mask. Before the walk
  each such call gets the explicit mask `arange(Lq)[:, None] >= arange(Lk)` of the global
  program (the same values, so the program is unchanged), which the walker then builds at the
  local query rows (the rows' `arange` sliced to this rank's positions).
- `carried_merges`: which inputs and results of an op carry a merged dim (`merges.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from portable.errors import PlanError
from portable.ir.plan import Plan
from portable.ir.rewriter import Rewriter
from portable.ir.sharding import Sharding
from portable.opset.bind import bind

from .merges import Merge

__all__ = ["carried_merges", "causal_masks", "check_context_plan"]

aten = torch.ops.aten
portable_ops = torch.ops.portable

_ATTENTION = (
    portable_ops.attention.default,
    portable_ops.attention_backward.default,
    portable_ops.attention_backward.mask_grad,
)


def check_context_plan(plan: Plan) -> None:
    """PlanError for what context parallelism does not combine with: its axis also splitting the
    batch, and Megatron sequence parallelism (which would split the same sequence dim again)."""
    axis = plan.context_axis
    if axis is None:
        return
    if axis in plan.batch_axes:
        raise PlanError(
            f"mesh axis {axis!r} is the context axis and also a batch axis",
            fix="give context parallelism an axis of its own: Mesh({'dp': 2, 'cp': 2}), "
            "batch_axes=('dp',), context_axis='cp'",
        )
    if plan.sequence_parallel is not None:
        raise PlanError(
            f"sequence_parallel={plan.sequence_parallel!r} together with "
            f"context_axis={axis!r} is not partitioned",
            fix="drop sequence_parallel: under context parallelism every activation is already "
            "split on the sequence",
        )


def causal_masks(graph: torch.fx.Graph) -> list[str]:
    """Give every causal attention (forward and backward) whose mask is absent or boolean an
    explicit boolean mask instead of `is_causal` (module doc); returns the names of the calls
    rewritten. A float mask with `is_causal` keeps it (that attention then runs on whole
    sequences: rules/nn.py)."""
    rewriter = Rewriter(graph)
    made: dict[tuple[int, int], torch.fx.Node] = {}
    changed: list[str] = []
    for node in list(graph.nodes):
        if node.target not in _ATTENTION:
            continue
        bound = bind(node)
        if not bound.is_causal:
            continue
        mask = bound.optional_node("mask")
        if mask is not None and mask.meta["tensor"].dtype != torch.bool:
            continue
        lq, lk = (
            int(bound.node("q").meta["tensor"].shape[-2]),
            int(bound.node("k").meta["tensor"].shape[-2]),
        )
        if (lq, lk) not in made:
            first = next(n for n in graph.nodes if n.op != "placeholder")
            made[(lq, lk)] = _causal(rewriter, first, node, lq, lk)
        keep = made[(lq, lk)]
        if mask is not None:
            with rewriter.at(before=node):
                keep = rewriter.call(
                    aten.bitwise_and.Tensor, (mask, keep), like=node, fake="none", name=None
                )
        rewriter.set_args(node, {"mask": keep, "is_causal": False})
        changed.append(node.name)
    return changed


def _causal(
    rewriter: Rewriter, before: torch.fx.Node, like: torch.fx.Node, lq: int, lk: int
) -> torch.fx.Node:
    """keep[i, j] = i >= j for i < lq, j < lk: `is_causal`'s top-left aligned mask."""
    with rewriter.at(before=before):
        rows = rewriter.call(
            aten.arange.start_step,
            (0, lq, 1),
            {"dtype": torch.int64},
            like=like,
            fake="none",
            name=None,
        )
        cols = rewriter.call(
            aten.arange.start_step,
            (0, lk, 1),
            {"dtype": torch.int64},
            like=like,
            fake="none",
            name=None,
        )
        column = rewriter.call(aten.unsqueeze.default, (rows, 1), like=like, fake="none", name=None)
        return rewriter.call(aten.ge.Tensor, (column, cols), like=like, fake="none", name=None)


Shape = Sequence[int]


def carried_merges(
    inputs: Iterable[tuple[Any, Shape, Sharding, Mapping[int, Merge]]],
    outputs: Sequence[tuple[Shape, Sharding] | None],
) -> tuple[dict[Any, dict[int, Merge]], list[dict[int, Merge]]]:
    """The merged dims an op's inputs must have and its results get.

    `inputs`: per tensor input, (key, global shape, the sharding its rule asks for, the merged
    dims it has). A merged dim the rule keeps split as it is stays merged, and every other dim
    of an input or result with the same global size and the same axes is that merged dim too
    (the rule lined them up: the rows of a matmul's result, the target of a loss, a tensor
    added to it). Returns (key -> merged dims wanted, per result its merged dims)."""
    inputs = list(inputs)
    known: dict[tuple[int, tuple[str, ...]], Merge] = {}
    for _, shape, want, have in inputs:
        for d, m in have.items():
            if want.dims[d] == m.axes:
                known[(int(shape[d]), m.axes)] = m

    def match(shape: Shape, sharding: Sharding) -> dict[int, Merge]:
        found: dict[int, Merge] = {}
        for d, axes in enumerate(sharding.dims):
            m = known.get((int(shape[d]), axes)) if axes else None
            if m is not None:
                found[d] = m
        return dict(list(found.items())[:1])  # one merged dim per value

    wanted = {key: match(shape, want) for key, shape, want, _ in inputs} if known else {}
    results = [match(*out) if (known and out is not None) else {} for out in outputs]
    return wanted, results
