"""Whether a chain of layout ops only flattens or unflattens a tensor (keeps its row-major
element order): how `softmax-fusion` sees through the views, permutes of size-1 dims and
unsqueezes that `torch.einsum` and `torch.matmul` put between a bmm and the 4-D scores.

Each dim of a value is described by the factors ("atoms") of the source tensor's dims it spans,
outermost first; a size-1 dim spans none. Reshapes regroup the atoms (splitting one where a new
dim boundary falls inside it), permutes reorder the dims, unsqueeze/squeeze add or drop empty
dims. The chain keeps the element order exactly when the atoms, read dim by dim, are the source's
own, in order.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch
from torch.fx import Node

from portable.opset import bind
from portable.opset.table import IDENTITY, PERMUTE, RESHAPE, UNIT_DIM, ops_with

__all__ = ["LAYOUT_OPS", "keeps_order", "layout_chain"]

aten = torch.ops.aten

_RESHAPE = ops_with(RESHAPE)
_IDENTITY = ops_with(IDENTITY) | {aten.expand.default}
_PERMUTE = ops_with(PERMUTE)
_UNIT = ops_with(UNIT_DIM)
LAYOUT_OPS = _RESHAPE | _IDENTITY | _PERMUTE | _UNIT


@dataclasses.dataclass(frozen=True)
class _Atom:
    dim: int  # the source tensor's dim
    inner: int  # the product of the source sizes inside this factor of that dim
    size: int


_Dims = tuple[tuple[_Atom, ...], ...]


def _shape(node: Node) -> tuple[int, ...]:
    return tuple(node.meta["tensor"].shape)


def _source(shape: tuple[int, ...]) -> _Dims:
    return tuple((_Atom(d, 1, n),) if n != 1 else () for d, n in enumerate(shape))


def _reshape(dims: _Dims, shape: tuple[int, ...]) -> _Dims | None:
    """The same atoms regrouped into `shape` (row-major); None if a boundary cannot be cut."""
    atoms = [a for dim in dims for a in dim]
    out = []
    for n in shape:
        taken: list[_Atom] = []
        while n > 1:
            if not atoms:
                return None
            a = atoms.pop(0)
            if a.size > n:  # split: the outer factor here, the inner one opens the next dim
                if a.size % n:
                    return None
                rest = a.size // n
                atoms.insert(0, _Atom(a.dim, a.inner, rest))
                a = _Atom(a.dim, a.inner * rest, n)
            elif n % a.size:
                return None
            taken.append(a)
            n //= a.size
        out.append(tuple(taken))
    return None if atoms else tuple(out)


def _perm(node: Node, rank: int) -> list[int]:
    if node.target is aten.permute.default:
        return [d % rank for d in typing.cast(list, bind(node).dims)]
    args = bind(node)
    a, b = (0, 1) if node.target is aten.t.default else (int(args.dim0), int(args.dim1))
    perm = list(range(rank))
    perm[a % rank], perm[b % rank] = perm[b % rank], perm[a % rank]
    return perm


def _step(dims: _Dims, node: Node) -> _Dims | None:
    """The dims of `node`'s result from those of its input (unsqueeze/squeeze are reshapes)."""
    out_shape = _shape(node)
    if node.target in _RESHAPE | _UNIT:
        return _reshape(dims, out_shape)
    if node.target in _PERMUTE:
        return tuple(dims[p] for p in _perm(node, len(dims)))
    return dims if _same_shape(node) or node.target not in LAYOUT_OPS else None


def layout_chain(node: Node, is_source: Any) -> list[Node] | str:
    """The layout ops from a node satisfying `is_source` back to `node` (source first, `node`
    last; [node] when `node` is the source), each used only by the next; or why there is none."""
    chain = [node]
    while not is_source(chain[0]):
        head = chain[0]
        if not (head.op == "call_function" and head.target in LAYOUT_OPS):
            return f"%{head.name} ({head.target})"
        up = bind(head).self  # every layout op transforms its `self`
        if not isinstance(up, Node):
            return f"%{head.name} ({head.target})"
        if len(up.users) != 1:
            return f"%{up.name}, used elsewhere too"
        chain.insert(0, up)
    return chain


def keeps_order(chain: list[Node]) -> bool:
    """Whether the layout ops of `chain` (source first) keep its row-major element order."""
    if all(node.target in _RESHAPE | _UNIT or _same_shape(node) for node in chain[1:]):
        return True  # reshapes and copies only (any sizes, symbolic ones too)
    if not all(isinstance(n, int) for node in chain for n in _shape(node)):
        return False  # permutes over symbolic sizes: not decided here
    source = _source(_shape(chain[0]))
    dims: _Dims | None = source
    for node in chain[1:]:
        dims = _step(dims, node) if dims is not None else None
    return dims is not None and _merged(dims) == _merged(source)


def _same_shape(node: Node) -> bool:
    """A clone, alias or expand to its input's own shape (an identity on the elements)."""
    if node.target not in _IDENTITY:
        return False
    return _shape(bind(node).node("self")) == _shape(node)


def _merged(dims: _Dims) -> list[_Atom]:
    """The atoms in order, adjacent factors of one source dim merged back."""
    out: list[_Atom] = []
    for a in (a for dim in dims for a in dim):
        if out and out[-1].dim == a.dim and out[-1].inner == a.inner * a.size:
            a = _Atom(a.dim, a.inner, out.pop().size * a.size)
        out.append(a)
    return out
