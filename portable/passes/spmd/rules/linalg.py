"""Matrix products: mm, bmm, addmm (batch, row, column and contraction splits; partial sums)."""

from __future__ import annotations

import torch
import torch.fx

from portable.ir.sharding import Sharding
from portable.opset.bind import bind

from .base import (
    Decision,
    RuleContext,
    rule,
)

aten = torch.ops.aten
portable_ops = torch.ops.portable


def _axis_state(s: Sharding, axis: str) -> tuple[str, int | None]:
    d = s.dim_of(axis)
    if d is not None:
        return "S", d
    if s.partial_op(axis):
        return "P", None
    return "R", None


def _matmul(ctx: RuleContext, a: torch.fx.Node, b: torch.fx.Node, nbatch: int):
    """Shardings for a [batch..., m, k] x b [batch..., k, n]; returns (a_req, b_req, out)."""
    sa, sb = ctx.sh(a), ctx.sh(b)
    m_dim, ka_dim = nbatch, nbatch + 1
    kb_dim, n_dim = nbatch, nbatch + 1
    a_dims: list[list[str]] = [[] for _ in range(nbatch + 2)]
    b_dims: list[list[str]] = [[] for _ in range(nbatch + 2)]
    o_dims: list[list[str]] = [[] for _ in range(nbatch + 2)]
    a_part: dict[str, str] = {}
    b_part: dict[str, str] = {}
    o_part: dict[str, str] = {}
    # on a conflict, gather the parameter (FSDP: weights are gathered, activations never);
    # between two parameters or two activations, the smaller one
    a_param, b_param = ctx.is_parameter(a), ctx.is_parameter(b)
    a_big = (b_param and not a_param) or (a_param == b_param and ctx.numel(a) >= ctx.numel(b))
    for axis in ctx.mesh.names:
        (ka, da), (kb, db) = _axis_state(sa, axis), _axis_state(sb, axis)
        # partial operands: linear in one of them
        if ka == "P" and kb == "P":
            ka = "R"  # reduce a
        if ka == "P":
            if kb == "R" and sa.partial_op(axis) in ("sum", "avg") and len(a.users) == 1:
                a_part[axis] = o_part[axis] = sa.partial_op(axis)
                continue
            ka = "R"
        if kb == "P":
            if ka == "R" and sb.partial_op(axis) in ("sum", "avg") and len(b.users) == 1:
                b_part[axis] = o_part[axis] = sb.partial_op(axis)
                continue
            kb = "R"
        a_role = None if ka == "R" else ("batch" if da < nbatch else "m" if da == m_dim else "k")
        b_role = None if kb == "R" else ("batch" if db < nbatch else "k" if db == kb_dim else "n")
        if a_role and b_role and not (a_role == b_role and (a_role != "batch" or da == db)):
            # conflict: gather the smaller operand along this axis
            if a_big:
                b_role = None
            else:
                a_role = None
        role = a_role or b_role
        if role is None:
            continue
        if role == "batch":
            d = da if a_role else db
            a_dims[d].append(axis)
            b_dims[d].append(axis)
            o_dims[d].append(axis)
        elif role == "m":
            a_dims[m_dim].append(axis)
            o_dims[m_dim].append(axis)
        elif role == "n":
            b_dims[n_dim].append(axis)
            o_dims[n_dim].append(axis)
        else:  # k on both: a partial sum
            a_dims[ka_dim].append(axis)
            b_dims[kb_dim].append(axis)
            o_part[axis] = "sum"
    mk = lambda dims, part: Sharding(tuple(tuple(d) for d in dims), tuple(sorted(part.items())))  # noqa: E731
    return mk(a_dims, a_part), mk(b_dims, b_part), mk(o_dims, o_part)


@rule(aten.mm.default)
def mm(ctx, node):
    bound = bind(node)
    a_req, b_req, out = _matmul(ctx, bound.node("self"), bound.node("mat2"), 0)
    return Decision({0: a_req, 1: b_req}, out)


@rule(aten.bmm.default)
def bmm(ctx, node):
    bound = bind(node)
    a_req, b_req, out = _matmul(ctx, bound.node("self"), bound.node("mat2"), 1)
    return Decision({0: a_req, 1: b_req}, out)


@rule(aten.addmm.default)
def addmm(ctx, node):
    """bias + a @ b. The walker splits it into mm + add when the product would be partial."""
    bound = bind(node)
    bias, a, b = bound.node("self"), bound.node("mat1"), bound.node("mat2")
    a_req, b_req, out = _matmul(ctx, a, b, 0)
    if out.partial:
        return Decision({}, None, args={"split": True})
    bshape = ctx.shape(bias)
    off = 2 - len(bshape)
    full = node.meta["tensor"].shape
    bdims = tuple(
        out.dims[d + off] if bshape[d] == full[d + off] else () for d in range(len(bshape))
    )
    return Decision({0: Sharding(bdims), 1: a_req, 2: b_req}, out)
