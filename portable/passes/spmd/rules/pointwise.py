"""Pointwise ops (broadcasting, partial sums through linear ops, sequence parallelism) and
reductions."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx

from portable.ir.sharding import Sharding
from portable.opset.bind import bind
from portable.opset.table import CAST, IDENTITY, ops_with
from portable.opset.table import ELEMENTWISE as _ELEMENTWISE_TRAIT

from .base import (
    Decision,
    Key,
    RuleContext,
    drop_partial,
    norm_dim,
    out_ndim,
    rule,
    tensor_args,
)

aten = torch.ops.aten
portable_ops = torch.ops.portable


_LINEAR_UNARY = ops_with(IDENTITY) | {aten.neg.default}
_ADDITIVE = {aten.add.Tensor, aten.sub.Tensor}
_MULTIPLICATIVE = {aten.mul.Tensor, aten.mul.Scalar}
_DIVISION = {aten.div.Tensor, aten.div.Scalar}


def _linear_partial(
    ctx: RuleContext, node: torch.fx.Node, partial_keys: list[Key], ops: list[str]
) -> bool:
    """Whether a partial value over one axis may flow through `node` unreduced."""
    if len(set(ops)) != 1 or ops[0] not in ("sum", "avg"):
        return False
    tensors = tensor_args(node)
    keys = [k for k, _ in tensors]
    if any(len(a.users) > 1 for k, a in tensors if k in partial_keys):
        return False  # reduce a shared partial value once, not once per linear consumer
    if node.target in _LINEAR_UNARY:
        return True
    if node.target is aten._to_copy.default:
        src = ctx.dtype(tensors[0][1])
        dst = bind(node).dtype
        dst = src if dst is None else dst
        return dst.is_floating_point and dst.itemsize >= src.itemsize
    if node.target in _ADDITIVE:
        return len(partial_keys) == len(keys) == 2 and bind(node).alpha == 1
    if node.target in _MULTIPLICATIVE:
        return len(partial_keys) == 1
    if node.target in _DIVISION:
        return partial_keys == [keys[0]]
    return False


def pointwise(ctx: RuleContext, node: torch.fx.Node, *, keep_partial: bool = True) -> Decision:
    """Broadcasting n-ary elementwise op: inputs aligned from the right; a dim split on any input
    is split on the output (replicated inputs are sliced locally, broadcast dims stay whole)."""
    tensors = tensor_args(node)
    nd = out_ndim(node)
    oshape = node.meta["tensor"].shape
    target: list[tuple[str, ...]] = [() for _ in range(nd)]
    used: set[str] = set()
    for _, arg in tensors:
        s, shape = ctx.sh(arg), ctx.shape(arg)
        off = nd - len(shape)
        for d, axes in enumerate(s.dims):
            if not axes or target[d + off] or used & set(axes):
                continue
            if shape[d] != oshape[d + off]:
                continue
            target[d + off] = axes
            used |= set(axes)
    partial: dict[str, str] = {}
    if keep_partial:
        for axis in ctx.mesh.names:
            if axis in used:
                continue
            pending = [(k, op) for k, a in tensors if (op := ctx.sh(a).partial_op(axis))]
            if not pending:
                continue
            pkeys, ops = [k for k, _ in pending], [op for _, op in pending]
            if _linear_partial(ctx, node, pkeys, ops):
                partial[axis] = ops[0]
            elif _sequence_split(ctx, axis, oshape, target):
                # sequence parallelism: reduce-scatter the partial sum onto the sequence dim
                # instead of all-reducing it; token-wise ops then run on a slice of the sequence
                target[1] = target[1] + (axis,)
                used.add(axis)
    out = Sharding(tuple(target), tuple(sorted(partial.items())))
    inputs: dict[Key, Sharding] = {}
    for key, arg in tensors:
        shape = ctx.shape(arg)
        off = nd - len(shape)
        dims = tuple(
            target[d + off] if shape[d] == oshape[d + off] else () for d in range(len(shape))
        )
        keep = {a: op for a, op in partial.items() if ctx.sh(arg).partial_op(a)}
        inputs[key] = Sharding(dims, tuple(sorted(keep.items())))
    return Decision(inputs, out)


def _sequence_split(
    ctx: RuleContext, axis: str, oshape: Sequence[int], target: Sequence[tuple[str, ...]]
) -> bool:
    """Whether a [batch, seq, hidden] activation may be split on seq over `axis`."""
    if ctx.sequence_parallel != axis or len(oshape) != 3:
        return False
    factor = math.prod(ctx.mesh.axis_size(a) for a in (*target[1], axis))
    return oshape[1] % factor == 0


ELEMENTWISE = ops_with(_ELEMENTWISE_TRAIT, IDENTITY, CAST) | {
    aten.lift_fresh_copy.default,  # a copy of a constant (no trait in the opset table)
    # not in the opset (a verified program has none of them); kept as the rule has always had
    aten.addcdiv.default,
    aten.lerp.Tensor,
    aten.masked_fill.Scalar,
}
"""Broadcasting elementwise ops: each output element is a function of the inputs' elements at
the same (broadcast) position, so any dim may be split (`pointwise`, and `localize.py`)."""
rule(*ELEMENTWISE)(pointwise)


@rule(aten.ones_like.default, aten.zeros_like.default, aten.full_like.default)
def like(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    x = bind(node).node("self")
    return Decision({"self": ctx.sh(x)}, drop_partial(ctx.sh(x)))


@rule(aten.tril.default, aten.triu.default)
def triangle(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """The last two dims whole (the diagonal is global); leading dims keep their splits."""
    s = drop_partial(ctx.sh(bind(node).node("self")))
    nd = len(s.dims)
    s = Sharding(s.dims[: nd - 2] + ((), ()))
    return Decision({"self": s}, s)


# --------------------------------------------------------------------------- reductions


@rule(aten.cumsum.default)
def cumsum(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """A prefix sum along `dim`: that dim whole, the others keep their splits."""
    bound = bind(node)
    s = drop_partial(ctx.sh(bound.node("self")))
    dim = norm_dim(bound.literal("dim"), len(s.dims))
    s = Sharding(tuple(() if d == dim else a for d, a in enumerate(s.dims)))
    return Decision({"self": s}, s)


def _reduction(
    ctx: RuleContext, node: torch.fx.Node, dims: Sequence[int] | None, keepdim: bool, kind: str
) -> Decision:
    x = bind(node).node("self")
    s = ctx.sh(x)
    nd = len(ctx.shape(x))
    rdims = set(range(nd)) if dims is None or len(dims) == 0 else {norm_dim(d, nd) for d in dims}
    # partial inputs stay partial only through a sum
    want_in = s if kind == "sum" else drop_partial(s)
    partial = dict(want_in.partial)
    out_dims: list[tuple[str, ...]] = []
    for d in range(nd):
        if d in rdims:
            for a in s.dims[d]:
                partial[a] = kind
            if keepdim:
                out_dims.append(())
        else:
            out_dims.append(s.dims[d])
    return Decision({"self": want_in}, Sharding(tuple(out_dims), tuple(sorted(partial.items()))))


@rule(aten.sum.dim_IntList)
def sum_dim(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    dims, keep = bound.get("dim"), bound.keepdim
    return _reduction(ctx, node, dims, keep, "sum")


@rule(aten.sum.default)
def sum_all(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    return _reduction(ctx, node, None, False, "sum")


@rule(aten.mean.dim)
def mean_dim(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    dims, keep = bound.get("dim"), bound.keepdim
    return _reduction(ctx, node, dims, keep, "avg")


@rule(aten.amax.default, aten.amin.default)
def amax(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    dims, keep = bound.dim, bound.keepdim
    kind = "max" if node.target is aten.amax.default else "min"
    return _reduction(ctx, node, dims, keep, kind)
