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


def _role(d: int, nbatch: int, rows: str, cols: str) -> tuple[str, int]:
    """(role, dim) of an operand whose dim `d` is split: a batch dim, or its rows or columns."""
    return ("batch" if d < nbatch else rows if d == nbatch else cols), d


def _matmul(
    ctx: RuleContext, a: torch.fx.Node, b: torch.fx.Node, nbatch: int
) -> tuple[Sharding, Sharding, Sharding]:
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
            op = sa.partial_op(axis)
            if kb == "R" and op in ("sum", "avg") and len(a.users) == 1:
                a_part[axis] = o_part[axis] = op
                continue
            ka = "R"
        if kb == "P":
            op = sb.partial_op(axis)
            if ka == "R" and op in ("sum", "avg") and len(b.users) == 1:
                b_part[axis] = o_part[axis] = op
                continue
            kb = "R"
        # a split operand's role along this axis (None: whole along it)
        a_role = None if da is None else _role(da, nbatch, "m", "k")
        b_role = None if db is None else _role(db, nbatch, "k", "n")
        if a_role and b_role:
            # both split: they agree on the same batch dim, or on k (a partial sum); else
            # conflict: gather the smaller operand along this axis. On the context axis two
            # activations conflict in attention (q @ k^T, p @ v and their backward), where a
            # holds this rank's queries: keys and values (b) are gathered, queries stay local
            agree = a_role[0] == b_role[0] and (a_role[0] != "batch" or da == db)
            keys = axis == ctx.context_axis and not a_param and not b_param
            if not agree and (keys or a_big):
                b_role = None
            elif not agree:
                a_role = None
        chosen = a_role or b_role
        if chosen is None:
            continue
        role, d = chosen
        if role == "batch":
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
def mm(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    a_req, b_req, out = _matmul(ctx, bound.node("self"), bound.node("mat2"), 0)
    return Decision({"self": a_req, "mat2": b_req}, out)


@rule(aten.bmm.default)
def bmm(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    a_req, b_req, out = _matmul(ctx, bound.node("self"), bound.node("mat2"), 1)
    return Decision({"self": a_req, "mat2": b_req}, out)


@rule(aten.addmm.default)
def addmm(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """bias + a @ b. The walker splits it into mm + add when the product would be partial."""
    bound = bind(node)
    bias, a, b = bound.node("self"), bound.node("mat1"), bound.node("mat2")
    a_req, b_req, out = _matmul(ctx, a, b, 0)
    if out.partial:
        return Decision({}, None, split_addmm=True)
    bshape = ctx.shape(bias)
    off = 2 - len(bshape)
    full = node.meta["tensor"].shape
    bdims = tuple(
        out.dims[d + off] if bshape[d] == full[d + off] else () for d in range(len(bshape))
    )
    return Decision({"self": Sharding(bdims), "mat1": a_req, "mat2": b_req}, out)
