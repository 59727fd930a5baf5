"""`canonicalize`: local algebraic simplifications, then dead-code removal.

Each pattern is one rewrite with its algebra in a comment; one walker (`rewrite`) applies them to
every live op until none matches, and the report counts matches per pattern. A match is only
applied when the replacement's recorded shape and dtype (`meta["tensor"]`) equal the original
node's, so no rewrite can change a program's types. Every rewrite is exact (bit-identical
results); a copy-like op that feeds a `view` is kept, because its input's layout might not be
viewable. Never rewritten: `x + 0 -> x` (wrong for -0.0: -0.0 + 0 == +0.0).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from portable.errors import PassError
from portable.ir.program import Program
from portable.ir.rewriter import NewNode, Pattern, Replacement, Rewriter
from portable.opset import bind
from portable.opset.table import CAST, IDENTITY, PERMUTE, RESHAPE, ops_with

from .base import Pass, PassResult
from .dce import remove_dead_code

__all__ = ["PATTERNS", "Canonicalize", "NewNode", "Pattern", "rewrite"]

aten = torch.ops.aten


def rewrite(
    graph: torch.fx.Graph, patterns: tuple[Pattern, ...], max_sweeps: int = 100
) -> tuple[Counter[str], bool]:
    """`Rewriter(graph).apply(patterns)`: matches per pattern, and whether a fixed point was
    reached. Replaced nodes are erased; their inputs may become dead (`remove_dead_code`)."""
    return Rewriter(graph).apply(patterns, max_sweeps)


# ---- helpers ---------------------------------------------------------------------------------

_RESHAPES = ops_with(RESHAPE)
_VIEWS = _RESHAPES - {aten.reshape.default}  # the ones that require a viewable input
_RESIZES = _RESHAPES | {aten.expand.default}
_PERMUTES = ops_with(PERMUTE)
_TRANSPOSE = frozenset({aten.transpose.int})
_COPIES = ops_with(IDENTITY)
_TO_COPY = ops_with(CAST)
_MUL = frozenset({aten.mul.Tensor, aten.mul.Scalar})
_DIV = frozenset({aten.div.Tensor, aten.div.Scalar})

# _to_copy keyword values that change nothing but the dtype
_NO_CHANGE = {
    "layout": (None, torch.strided),
    "memory_format": (None, torch.preserve_format),
    "device": (None,),
    "pin_memory": (None, False),
    "non_blocking": (False,),
}


def _call(value: Any, targets: frozenset) -> Node | None:
    """`value` if it is an op in `targets`, else None."""
    is_op = isinstance(value, Node) and value.op == "call_function" and value.target in targets
    return value if is_op else None


def _input(node: Node) -> Node:
    """The `self` operand: the tensor every pattern here transforms."""
    return bind(node).node("self")


def _shape(node: Node) -> Any:
    """The target shape of a view / reshape / expand (`size`, or reshape's `shape`)."""
    b = bind(node)
    return b["size"] if "size" in b else b["shape"]


def _rank(node: Node) -> int:
    return len(node.meta["tensor"].shape)


def _perm(node: Node) -> list[int]:
    """The permutation a permute/transpose/t applies: output dim i is input dim perm[i]."""
    n, args = _rank(node), bind(node)
    if node.target is aten.permute.default:
        return [d % n for d in args.dims] if n else []
    perm = list(range(n))
    if n:
        is_transpose = node.target is aten.transpose.int
        a, b = (args.dim0 % n, args.dim1 % n) if is_transpose else (0, n - 1)
        perm[a], perm[b] = perm[b], perm[a]
    return perm


def _feeds_view(node: Node) -> bool:
    """Whether a view uses `node`. An eager `view` (and the verifier's shape rule) needs a layout
    that only a copy may provide, so a copy-like op feeding one keeps its place."""
    return any(_call(user, _VIEWS) for user in node.users)


def _is_one(value: Any) -> bool:
    return type(value) in (int, float) and value == 1


# ---- patterns --------------------------------------------------------------------------------


def _identity_reshape(node: Node) -> Replacement | None:
    # reshape(x, shape(x)) -> x   (view, _unsafe_view, reshape, expand; the walker checks the shape)
    return _input(node) if _call(node, _RESIZES) else None


def _reshape_chain(node: Node) -> Replacement | None:
    # reshape(reshape(x, s1), s2) -> reshape(x, s2)   (both keep row-major element order)
    # A view of a view stays a view; a reshape anywhere makes the result a reshape, because
    # that reshape may have copied into a layout that a view of x could not take.
    inner = _call(_input(node), _RESHAPES) if _call(node, _RESHAPES) else None
    if inner is None:
        return None
    target = node.target if inner.target in _VIEWS else aten.reshape.default
    return NewNode(target, (_input(inner), _shape(node)))


def _identity_permute(node: Node) -> Replacement | None:
    # permute(x, [0, 1, ..., n-1]) -> x ;  transpose(x, a, a) -> x ;  t(x) -> x for rank < 2
    is_identity = _call(node, _PERMUTES) and _perm(node) == list(range(_rank(node)))
    return _input(node) if is_identity else None


def _transpose_pair(node: Node) -> Replacement | None:
    # transpose(transpose(x, a, b), a, b) -> x   (also with a and b swapped)
    inner = _call(_input(node), _TRANSPOSE) if _call(node, _TRANSPOSE) else None
    return _input(inner) if inner is not None and _perm(inner) == _perm(node) else None


def _permute_chain(node: Node) -> Replacement | None:
    # permute(permute(x, p), q) -> permute(x, [p[q[0]], ..., p[q[n-1]]])  (-> x if that is identity)
    inner = _call(_input(node), _PERMUTES) if _call(node, _PERMUTES) else None
    if inner is None:
        return None
    p, q = _perm(inner), _perm(node)
    composed = [p[i] for i in q]
    if composed == list(range(len(composed))):
        return _input(inner)
    return NewNode(aten.permute.default, (_input(inner), composed))


def _view_of_copy(node: Node) -> Replacement | None:
    # view(clone(x), s) -> reshape(x, s)   (reshape copies exactly when x's layout cannot be viewed)
    inner = _call(_input(node), _COPIES) if _call(node, _VIEWS) else None
    return NewNode(aten.reshape.default, (_input(inner), _shape(node))) if inner else None


def _clone(node: Node) -> Replacement | None:
    # clone(x) -> x ; alias(x) -> x        (graphs are functional: nothing writes in place)
    # Kept while a view uses the copy (see `_feeds_view`; view-of-copy rewrites those views).
    return _input(node) if _call(node, _COPIES) and not _feeds_view(node) else None


def _same_dtype_copy(node: Node) -> Replacement | None:
    # _to_copy(x, dtype=dtype(x)) -> x     (no layout, device or memory-format change)
    if not _call(node, _TO_COPY) or _feeds_view(node):
        return None
    x = _input(node)
    for key, value in bind(node).items():  # every argument but self is keyword-only
        if key == "self":
            continue
        if key == "dtype":
            if value is not None and value != x.meta["tensor"].dtype:
                return None
        elif value not in _NO_CHANGE.get(key, ()):
            return None
    return x


def _mul_by_one(node: Node) -> Replacement | None:
    # x * 1 -> x ; 1 * x -> x     (exact for every value, -0.0, inf and NaN included)
    if not _call(node, _MUL) or _feeds_view(node):
        return None
    a, b = bind(node).self, bind(node).other
    if _is_one(b) and isinstance(a, Node):
        return a
    if _is_one(a) and isinstance(b, Node):
        return b
    return None


def _div_by_one(node: Node) -> Replacement | None:
    # x / 1 -> x      (true division only; the walker rejects int x, whose x / 1 is float)
    matches = _call(node, _DIV) and _is_one(bind(node).other) and not node.kwargs
    return _input(node) if matches and not _feeds_view(node) else None


PATTERNS: tuple[Pattern, ...] = (
    Pattern("identity-reshape", _identity_reshape),
    Pattern("reshape-chain", _reshape_chain),
    Pattern("identity-permute", _identity_permute),
    Pattern("transpose-pair", _transpose_pair),
    Pattern("permute-chain", _permute_chain),
    Pattern("view-of-copy", _view_of_copy),
    Pattern("clone", _clone),
    Pattern("same-dtype-copy", _same_dtype_copy),
    Pattern("mul-by-one", _mul_by_one),
    Pattern("div-by-one", _div_by_one),
)


@dataclasses.dataclass(frozen=True)
class Canonicalize(Pass):
    """`disable`: comma-separated pattern names to skip (see `PATTERNS`).

    Counts: matches per pattern, and `dead-code` for the ops removed afterwards."""

    name = "canonicalize"
    disable: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        known = [p.name for p in PATTERNS]
        unknown = [n for n in self.disabled() if n not in known]
        if unknown:
            raise PassError(
                f"canonicalize has no pattern {', '.join(map(repr, unknown))}",
                pass_name=self.name,
                fix=f"patterns: {', '.join(known)}",
            )

    def disabled(self) -> list[str]:
        return [n.strip() for n in self.disable.split(",") if n.strip()]

    def apply(self, program: Program) -> PassResult:
        out = program.replace()
        patterns = tuple(p for p in PATTERNS if p.name not in self.disabled())
        counts, converged = rewrite(out.graph, patterns)
        dead = remove_dead_code(out.graph)
        report = {**{p.name: counts[p.name] for p in patterns}, "dead-code": dead}
        if not any(report.values()):
            return PassResult(program, self.report(False, report))
        out.graph_module.recompile()
        notes = [] if converged else ["stopped before a fixed point; run canonicalize again"]
        return PassResult(out, self.report(True, report, notes))
