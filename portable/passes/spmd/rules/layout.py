"""Layout ops: transposes, reshapes (dim groups), expand, slice, select, split, cat, the scatters
of a slice or a selection, advanced indexing."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx

from portable.ir.sharding import Sharding
from portable.opset.bind import Bound, bind
from portable.opset.table import RESHAPE, ops_with

from ..merges import Merge, merge_of, unmerged_splits
from .base import (
    Decision,
    Key,
    RuleContext,
    drop_partial,
    merged_dims,
    norm_dim,
    out_ndim,
    replicate_all,
    rule,
    unshard_dims,
)

aten = torch.ops.aten
portable_ops = torch.ops.portable


@rule(aten.t.default)
def t(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    s = ctx.sh(bind(node).node("self"))
    dims = s.dims[::-1] if len(s.dims) == 2 else s.dims
    return Decision({"self": s}, Sharding(dims, s.partial))


@rule(aten.transpose.int)
def transpose(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = ctx.sh(bound.node("self"))
    nd = len(s.dims)
    d0, d1 = norm_dim(bound.literal("dim0"), nd), norm_dim(bound.literal("dim1"), nd)
    dims = list(s.dims)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return Decision({"self": s}, Sharding(tuple(dims), s.partial))


@rule(aten.permute.default)
def permute(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = ctx.sh(bound.node("self"))
    nd = len(s.dims)
    order = [norm_dim(d, nd) for d in bound.literal("dims")]
    return Decision({"self": s}, Sharding(tuple(s.dims[d] for d in order), s.partial))


def dim_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of src dims and dst dims with equal products (a reshape's dim mapping)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        if i < len(src):
            gi.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj *= dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi *= src[i]
                i += 1
            elif pj < pi and j < len(dst):
                gj.append(j)
                pj *= dst[j]
                j += 1
            else:
                return None
        # absorb trailing size-1 dims into this group
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _reshape(
    ctx: RuleContext, node: torch.fx.Node
) -> tuple[Sharding, Sharding, dict[int, Merge]] | None:
    """(required input, output, merged output dims) of a reshape: a split dim stays split when
    it leads its group of merged/split dims and the axes divide the output dim it maps to; other
    split dims are gathered first. Under context parallelism a group that the context axis
    splits keeps every split (`_context_group`). None when the dims do not group (then: full
    copies)."""
    x = bind(node).node("self")
    s, src, dst = ctx.sh(x), ctx.shape(x), tuple(node.meta["tensor"].shape)
    groups = dim_groups(src, dst)
    if groups is None:
        return None
    in_dims = [list(d) for d in s.dims]
    out_dims: list[tuple[str, ...]] = [() for _ in dst]
    merged: dict[int, Merge] = {}
    for gi, gj in groups:
        if _context_group(ctx, x, (src, dst), (gi, gj), in_dims, out_dims, merged):
            continue
        lead_i = next((d for d in gi if src[d] != 1), None)
        lead_j = next((d for d in gj if dst[d] != 1), None)
        for d in gi:
            if not in_dims[d]:
                continue
            factor = math.prod(ctx.mesh.axis_size(a) for a in in_dims[d])
            if d == lead_i and lead_j is not None and dst[lead_j] % factor == 0:
                out_dims[lead_j] = tuple(in_dims[d])
            else:
                in_dims[d] = []
    return (
        Sharding(tuple(tuple(d) for d in in_dims), s.partial),
        Sharding(tuple(out_dims), s.partial),
        merged,
    )


def _context_group(
    ctx: RuleContext,
    x: torch.fx.Node,
    shapes: tuple[Sequence[int], Sequence[int]],
    group: tuple[list[int], list[int]],
    in_dims: list[list[str]],
    out_dims: list[tuple[str, ...]],
    merged: dict[int, Merge],
) -> bool:
    """Decide one group of a reshape under context parallelism (False: the ordinary rule).

    Tokens split over the context axis are merged with the batch ([B, T/cp, C] -> [B*T/cp, C])
    without moving them: the merged dim is recorded as a `Merge` when its rows are not a
    contiguous chunk; a merged dim is unmerged into the dims it was made of (the splits come
    back), and a contiguous split is spread over the dims it is reshaped into. A group that
    cannot keep its splits is gathered (the walker's redistributor unmerges first)."""
    (src, dst), (gi, gj) = shapes, group
    mesh, have = ctx.mesh, ctx.merges(x)
    wide_i = [d for d in gi if src[d] != 1]
    wide_j = [d for d in gj if dst[d] != 1]
    merged_here = [d for d in gi if d in have]
    if len(merged_here) > 1:  # not made by the pass (one merged dim per value): gather them
        for dd in gi:
            in_dims[dd] = []
        return True
    if merged_here:
        (d,) = merged_here
        m = have[d]
        if wide_i == [d] and tuple(dst[j] for j in wide_j) == m.sizes:
            for j, axes in zip(wide_j, m.splits, strict=True):
                out_dims[j] = axes  # unmerged: each dim gets its own split back
            return True
        if wide_i == [d] and len(wide_j) == 1 and dst[wide_j[0]] == src[d]:
            out_dims[wide_j[0]] = tuple(in_dims[d])  # the merged dim itself, moved
            merged[wide_j[0]] = m
            return True
        for dd in gi:
            in_dims[dd] = []
        return True
    axis = ctx.context_axis
    if axis is None or not any(axis in in_dims[d] for d in gi):
        return False
    if len(wide_j) == 1:
        axes, made = merge_of([src[d] for d in gi], [in_dims[d] for d in gi], mesh)
        if made is not None and (merged or any(d not in gi for d in have)):
            for dd in gi:  # one merged dim per value
                in_dims[dd] = []
            return True
        out_dims[wide_j[0]] = axes
        if made is not None:
            merged[wide_j[0]] = made
        return True
    if len(wide_i) == 1:
        (d,) = wide_i
        splits = unmerged_splits(in_dims[d], [dst[j] for j in wide_j], mesh)
        if splits is None:
            in_dims[d] = []
        else:
            for j, axes in zip(wide_j, splits, strict=True):
                out_dims[j] = axes
        return True
    return False


def sizes_argument(bound: Bound) -> str:
    """The name of a reshape's sizes argument: `shape` of reshape, `size` of view."""
    return "shape" if "shape" in bound else "size"


@rule(*ops_with(RESHAPE))
def view(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """A reshape: its sizes argument becomes the local sizes."""
    shardings = _reshape(ctx, node)
    if shardings is None:
        return replicate_all(ctx, node)
    req, out, merged = shardings
    local = list(out.local_shape(node.meta["tensor"].shape, ctx.mesh))
    sizes = {sizes_argument(bind(node)): local}
    return Decision({"self": req}, out, args=sizes, merged=merged)


@rule(aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def view_like(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """A reshape whose size argument is implied: no argument to rewrite."""
    shardings = _reshape(ctx, node)
    if shardings is None:
        return replicate_all(ctx, node)
    req, out, merged = shardings
    return Decision({"self": req}, out, merged=merged)


@rule(aten.expand.default)
def expand(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    x = bound.node("self")
    s, src = ctx.sh(x), ctx.shape(x)
    dst = tuple(node.meta["tensor"].shape)
    off = len(dst) - len(src)
    out_dims = [()] * off + [s.dims[d] if src[d] == dst[d + off] else () for d in range(len(src))]
    out = Sharding(tuple(out_dims), s.partial)
    local, given = list(out.local_shape(dst, ctx.mesh)), bound.literal("size")
    sizes = [-1 if (d >= off and given[d] == -1) else local[d] for d in range(len(dst))]
    return Decision({"self": Sharding(tuple(out_dims[off:]), s.partial)}, out, args={"size": sizes})


@rule(aten.slice.Tensor)
def slice_(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    x = bound.node("self")
    s, shape = ctx.sh(x), ctx.shape(x)
    dim = norm_dim(bound.dim, len(shape))
    out_shape = node.meta["tensor"].shape
    if s.dims[dim] and out_shape[dim] != shape[dim]:
        s = unshard_dims(s, [dim])
    return Decision({"self": s}, s)


@rule(aten.select.int)
def select(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = ctx.sh(bound.node("self"))
    dim = norm_dim(bound.literal("dim"), len(s.dims))
    s = unshard_dims(s, [dim])
    out = Sharding(s.dims[:dim] + s.dims[dim + 1 :], s.partial)
    return Decision({"self": s}, out)


@rule(aten.split_with_sizes.default, aten.split.Tensor)
def split(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    s = ctx.sh(bound.node("self"))
    dim = norm_dim(bound.dim, len(s.dims))
    s = unshard_dims(s, [dim])
    return Decision({"self": s}, tuple(s for _ in node.meta["tensor"]))


@rule(aten.cat.default)
def cat(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    tensors = bound.tensors
    nd = out_ndim(node)
    dim = norm_dim(bound.dim, nd)
    s = Sharding(merged_dims([ctx.sh(t) for t in tensors], whole=[dim]))
    return Decision({("tensors", j): s for j in range(len(tensors))}, s)


@rule(aten.slice_scatter.default)
def slice_scatter(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """x with a slice along `dim` replaced by src: split like either, `dim` whole."""
    bound = bind(node)
    x, src = bound.node("self"), bound.node("src")
    dim = norm_dim(bound.dim, len(ctx.shape(x)))
    s = Sharding(merged_dims([ctx.sh(x), ctx.sh(src)], whole=[dim]))
    return Decision({"self": s, "src": s}, s)


@rule(aten.select_scatter.default)
def select_scatter(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """x with x.select(dim, i) replaced by src (which lacks `dim`)."""
    bound = bind(node)
    x, src = bound.node("self"), bound.node("src")
    dim = norm_dim(bound.literal("dim"), len(ctx.shape(x)))
    sx, ss = ctx.sh(x), ctx.sh(src)
    widened = Sharding(ss.dims[:dim] + ((),) + ss.dims[dim:])
    s = Sharding(merged_dims([sx, widened], whole=[dim]))
    return Decision({"self": s, "src": Sharding(s.dims[:dim] + s.dims[dim + 1 :])}, s)


@rule(aten.gather.default)
def gather(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """out[..., j, ...] = x[..., index[..., j, ...], ...] along `dim`: `dim` whole on both; another
    dim is split alike on x and index where their sizes agree (x whole where index is shorter)."""
    bound = bind(node)
    x, idx = bound.node("self"), bound.node("index")
    xshape, ishape = ctx.shape(x), ctx.shape(idx)
    dim = norm_dim(bound.literal("dim"), len(xshape))
    whole = [dim, *(d for d in range(len(xshape)) if xshape[d] != ishape[d])]
    s = Sharding(merged_dims([drop_partial(ctx.sh(x)), drop_partial(ctx.sh(idx))], whole=whole))
    return Decision({"self": s, "index": s}, s)


@rule(aten.index.Tensor)
def index(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """x[i, j, ...] with leading index tensors: the output is the indices' broadcast shape, then
    x's dims after the indexed ones. Indexed dims of x are whole (the indices are global
    positions); the other dims of x and the indices' dims keep their splits."""
    bound = bind(node)
    x, indices = bound.node("self"), bound.indices
    if any(i is None for i in indices):
        return replicate_all(ctx, node)
    xs = drop_partial(ctx.sh(x))
    k = len(indices)
    rest = xs.dims[k:]
    nb = out_ndim(node) - len(rest)
    bshape = tuple(node.meta["tensor"].shape[:nb])
    taken = {a for d in rest for a in d}
    aligned = []
    for i in indices:
        shape, s = ctx.shape(i), drop_partial(ctx.sh(i))
        off = nb - len(shape)
        dims: list[tuple[str, ...]] = [() for _ in range(nb)]
        for d, axes in enumerate(s.dims):
            if shape[d] == bshape[d + off] and not taken & set(axes):
                dims[d + off] = axes
        aligned.append(Sharding(tuple(dims)))
    front = merged_dims(aligned) if aligned else ()
    inputs: dict[Key, Sharding] = {"self": Sharding(((),) * k + rest)}
    for j, i in enumerate(indices):
        shape = ctx.shape(i)
        off = nb - len(shape)
        inputs[("indices", j)] = Sharding(
            tuple(front[d + off] if shape[d] == bshape[d + off] else () for d in range(len(shape)))
        )
    return Decision(inputs, Sharding(front + rest))
