"""Replicated values computed at the local size where a consumer needs them split.

A value no split input flows into is computed whole on every rank: a causal mask built from
`arange`/`full`/`expand` sized by the global batch, the zeros a slice's backward scatters into.
When a batch- or head-split consumer needs it split, slicing the finished value (`local_shard`)
gives the right numbers but costs the global tensor on every rank, however many ranks share the
batch. Instead the split is pushed to the value's producers, through identities of `chunk(., d)`
(this rank's chunk of dim d):

    chunk(full(sizes), d)              = full(sizes with dim d local)     also zeros, ones, empty
    chunk(f(a, b), d)                  = f(chunk(a, d), chunk(b, d))      f elementwise; a dim an
                                                                          input broadcasts stays
    chunk(expand(x, sizes), d)         = expand(chunk(x, d), local sizes) x's dim d broadcast: x
    chunk(unsqueeze(x, u), d)          = unsqueeze(chunk(x, d - (d > u)), u)
    chunk(view(x, sizes), d)           = view(chunk(x, d'), local sizes)  d' leads d's dim group
    chunk(slice(x, e, ...), d)         = slice(chunk(x, d), e, ...)       d != e; also cat
    chunk(index(x, [i, j]), d)         = index(x, [chunk(i, d), chunk(j, d)])  d from the indices
    chunk(embedding(w, ids), d)        = embedding(w, chunk(ids, d))      d < ids.ndim

so every size argument becomes the local size and the value is born split. Where no identity
applies (an `arange`, a parameter, a collective's result) the walk stops and that input is sliced
with `local_shard`, which is exact: an `arange` of the global batch then holds this rank's global
row indices, which is what an `index` into a replicated value needs. Values are only rewritten
when they carry no partial sum; the replicated original stays for any consumer that needs it
whole (dead code elimination removes it otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from portable.errors import PlanError
from portable.ir.rewriter import Rewriter, replaced_args
from portable.ir.sharding import Sharding
from portable.opset.bind import bind
from portable.opset.table import RESHAPE, ops_with

from .rules.base import single
from .rules.layout import dim_groups, sizes_argument
from .rules.pointwise import ELEMENTWISE

if TYPE_CHECKING:
    from .redistribute import Redistributor

__all__ = ["localize"]

aten = torch.ops.aten

Dims = tuple[tuple[str, ...], ...]
Call = tuple[tuple[Any, ...], dict[str, Any]]  # a call's args and kwargs
# (redistributor, value, wanted output dims, insert-before node) -> the local call, or None
Handler = Callable[["Redistributor", torch.fx.Node, Dims, torch.fx.Node], Call | None]


def localize(
    red: Redistributor, value: torch.fx.Node, want: Sharding, before: torch.fx.Node
) -> torch.fx.Node | None:
    """`value` recomputed directly in sharding `want` (which only adds splits to its current,
    partial-free sharding), inserted before `before`; None when no identity applies."""
    target = value.target
    if not isinstance(target, torch._ops.OpOverload) or target not in _HANDLERS:
        return None
    if want.partial or single(value, red.sharding[value]).partial:
        return None
    if not _divides(red, want.dims, red.global_shape[value]):
        return None  # left to local_shard, whose error explains the arithmetic
    rewritten = _HANDLERS[target](red, value, want.dims, before)
    if rewritten is None:
        return None
    args, kwargs = rewritten
    node = Rewriter(red.graph).call(
        target, args, kwargs, like=value, fake="none", name=None, before=before
    )
    red.record(node, want, red.global_shape[value], red.dtype[value])
    return node


# ---------------------------------------------------------------------------- helpers


def _divides(red: Redistributor, dims: Sequence[Sequence[str]], shape: Sequence[int]) -> bool:
    try:
        Sharding(tuple(tuple(d) for d in dims)).local_shape(shape, red.mesh)
    except PlanError:
        return False
    return True


def _split(
    red: Redistributor, arg: Any, dims: Sequence[Sequence[str]], before: torch.fx.Node
) -> Any:
    """`arg` (a node) in the sharding with `dims`; anything else unchanged."""
    if not isinstance(arg, torch.fx.Node) or arg not in red.sharding:
        return arg
    return red.to(arg, Sharding(tuple(tuple(d) for d in dims)), before)


def _aligned(
    red: Redistributor, arg: torch.fx.Node, out_shape: Sequence[int], dims: Dims
) -> list[tuple[str, ...]]:
    """The dims of `arg` under broadcasting to `out_shape` split as `dims` (aligned from the
    right; a dim `arg` broadcasts stays whole)."""
    shape = red.global_shape[arg]
    off = len(out_shape) - len(shape)
    return [dims[d + off] if shape[d] == out_shape[d + off] else () for d in range(len(shape))]


def _local_sizes(red: Redistributor, value: torch.fx.Node, dims: Dims) -> list[int]:
    return list(Sharding(dims).local_shape(red.global_shape[value], red.mesh))


def _map_tensors(
    red: Redistributor,
    value: torch.fx.Node,
    before: torch.fx.Node,
    want_of: Callable[[torch.fx.Node], Sequence[Sequence[str]]],
) -> Call:
    """value's args and kwargs with every tensor argument brought to `want_of(arg)`."""

    def one(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node) and arg in red.sharding:
            return _split(red, arg, want_of(arg), before)
        if isinstance(arg, (list, tuple)):
            return type(arg)(one(a) for a in arg)
        return arg

    return tuple(one(a) for a in value.args), {k: one(v) for k, v in value.kwargs.items()}


# ---------------------------------------------------------------------------- identities


def _creation(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    # full(size, fill), zeros(size), ones(size), empty(size)
    return replaced_args(value, {"size": _local_sizes(red, value, dims)})


def _elementwise(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    out = red.global_shape[value]
    return _map_tensors(red, value, before, lambda a: _aligned(red, a, out, dims))


def _expand(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    x = bind(value).node("self")
    arg = _split(red, x, _aligned(red, x, red.global_shape[value], dims), before)
    return replaced_args(value, {"self": arg, "size": _local_sizes(red, value, dims)})


def _unsqueeze(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    bound = bind(value)
    x, u = bound.node("self"), bound.literal("dim")
    u = u + len(dims) if u < 0 else u
    if dims[u]:
        return None
    return replaced_args(value, {"self": _split(red, x, dims[:u] + dims[u + 1 :], before)})


def _view(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    """A split output dim must lead its group of merged/split dims (layout.dim_groups)."""
    bound = bind(value)
    x = bound.node("self")
    src, dst = red.global_shape[x], red.global_shape[value]
    groups = dim_groups(src, dst)
    if groups is None:
        return None
    arg_dims: list[tuple[str, ...]] = [() for _ in src]
    for gi, gj in groups:
        split = [d for d in gj if dims[d]]
        if not split:
            continue
        lead_i = next((d for d in gi if src[d] != 1), None)
        lead_j = next((d for d in gj if dst[d] != 1), None)
        if split != [lead_j] or lead_i is None or lead_j is None:
            return None
        arg_dims[lead_i] = dims[lead_j]
    if not _divides(red, arg_dims, src):
        return None
    arg = _split(red, x, arg_dims, before)
    sizes = sizes_argument(bound)
    return replaced_args(value, {"self": arg, sizes: _local_sizes(red, value, dims)})


def _along(dim_arg: int, ndim: int) -> int:
    return dim_arg + ndim if dim_arg < 0 else dim_arg


def _slice(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    bound = bind(value)
    dim = _along(bound.dim, len(dims))
    if dims[dim]:
        return None
    return replaced_args(value, {"self": _split(red, bound.node("self"), dims, before)})


def _cat(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    bound = bind(value)
    dim = _along(bound.dim, len(dims))
    if dims[dim]:
        return None
    return replaced_args(value, {"tensors": [_split(red, t, dims, before) for t in bound.tensors]})


def _index(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    """x[i, j, ...] with leading index tensors (no `None` among them): the output's first dims
    are the indices' broadcast shape, the rest are x's dims after the indexed ones."""
    bound = bind(value)
    x, indices = bound.node("self"), bound.indices
    if any(i is None for i in indices):
        return None
    nb = len(dims) - (len(red.global_shape[x]) - len(indices))
    bshape = red.global_shape[value][:nb]
    x_dims = [()] * len(indices) + list(dims[nb:])
    if list(single(x, red.sharding[x]).dims[: len(indices)]) != [()] * len(indices):
        return None
    arg = _split(red, x, x_dims, before)
    parts = [_split(red, i, _aligned(red, i, bshape, dims[:nb]), before) for i in indices]
    return replaced_args(value, {"self": arg, "indices": parts})


def _embedding(
    red: Redistributor, value: torch.fx.Node, dims: Dims, before: torch.fx.Node
) -> Call | None:
    ids = bind(value).node("indices")
    if dims[-1] != single(value, red.sharding[value]).dims[-1]:
        return None
    return replaced_args(value, {"indices": _split(red, ids, dims[:-1], before)})


_CREATION = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)
_LIKE = (aten.ones_like.default, aten.zeros_like.default, aten.full_like.default)
_HANDLERS: dict[Any, Handler] = {
    **dict.fromkeys(_CREATION, _creation),
    **dict.fromkeys((*ELEMENTWISE, *_LIKE), _elementwise),
    aten.expand.default: _expand,
    aten.unsqueeze.default: _unsqueeze,
    **dict.fromkeys(ops_with(RESHAPE), _view),
    aten.slice.Tensor: _slice,
    aten.cat.default: _cat,
    aten.index.Tensor: _index,
    aten.embedding.default: _embedding,
}
