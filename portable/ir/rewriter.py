"""One rewriter for every pass: insert, replace and erase nodes with their metadata carried, and
apply rewrite patterns with a count per pattern.

A node a pass creates must look like one capture created: a fake value `meta["val"]` (backends
read its strides), a `meta["tensor"]` TensorSpec (the printer, verifier and serializer read it),
and the user's source line `meta["source"]` (errors point at it). `Rewriter.call` gives it all
three. Patterns (`Pattern`, `NewNode`) are the house style for local rewrites: each has a name
and its algebra in a comment; `Rewriter.apply` walks the graph until none matches and returns
the matches per pattern, which the pass reports.

Fake values: by default (`fake="inputs"`) the op runs on its inputs' fake values, in their fake
mode; an input without one is faked from its `meta["tensor"]`. `fake="specs"` fakes every input
from its TensorSpec in a fresh mode (contiguous strides: what a per-rank program's inputs are).
`fake="available"` sets a value only when every input node has one (none is invented).
`fake="none"` sets none: for a pass whose graph is between two shapes (spmd-partition inserts
collectives over per-rank shapes into a graph of global ones, then infers every value afresh).
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import Node

from ..opset import op_name
from ..opset.bind import OperandError
from .signature import TensorSpec

__all__ = ["OP_NAME", "NewNode", "Pattern", "Rewriter", "replaced_args"]

FakePolicy = Literal["inputs", "specs", "available", "none"]


class _OpName:
    """The `name` default of `Rewriter.call`: the op's short name (%reshape, %reshape_1,
    %getitem_5), as capture names nodes; pass `name=None` for torch.fx's default naming."""


OP_NAME: Any = _OpName()
_UNSET: Any = object()


@dataclasses.dataclass(frozen=True)
class NewNode:
    """A replacement op to insert before the matched node; it inherits the node's metadata
    (same value, so same recorded type and source) except the layout-specific `val` and
    `tensor_meta`."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


Replacement = Node | NewNode


@dataclasses.dataclass(frozen=True)
class Pattern:
    """`match(node)` returns what replaces `node` (an existing value or a new op), or None."""

    name: str
    match: Callable[[Node], Replacement | None]


def short_name(target: Any) -> str:
    """`reshape` for aten.reshape.default, `getitem` for operator.getitem."""
    return "getitem" if target is operator.getitem else op_name(target).split(".")[1]


class Rewriter:
    """Edits one graph. Nodes are created at the graph's insertion point unless `before` or
    `after` is given (`at` sets it for a block)."""

    def __init__(self, graph: torch.fx.Graph) -> None:
        self.graph = graph

    # ---- creating nodes --------------------------------------------------------------------

    @contextmanager
    def at(self, *, before: Node | None = None, after: Node | None = None) -> Iterator[None]:
        """Insert the block's nodes before `before` (or after `after`)."""
        point = (
            self.graph.inserting_before(before)
            if before is not None
            else self.graph.inserting_after(after)
        )
        with point:
            yield

    def call(
        self,
        target: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        *,
        source: Any = _UNSET,
        like: Node | None = None,
        tensor: Any = None,
        fake: FakePolicy = "inputs",
        name: Any = OP_NAME,
        before: Node | None = None,
    ) -> Node:
        """A call_function node of `target` with `meta["val"]` (by `fake`, see the module
        docstring), `meta["tensor"]` (`tensor`, else the spec of the fake value) and
        `meta["source"]` (`source`, else `like`'s source when it has one)."""
        kwargs = kwargs or {}
        node_name = short_name(target) if name is OP_NAME else name
        if before is not None:
            with self.graph.inserting_before(before):
                node = self.graph.create_node("call_function", target, args, kwargs, node_name)
        else:
            node = self.graph.create_node("call_function", target, args, kwargs, node_name)
        val = None if fake == "none" else fake_value(target, args, kwargs, fake)
        if val is not None:
            node.meta["val"] = val
        spec = tensor if tensor is not None else _spec_of(val)
        if spec is not None:
            node.meta["tensor"] = spec
        if source is not _UNSET:
            node.meta["source"] = source
        elif like is not None and "source" in like.meta:
            node.meta["source"] = like.meta["source"]
        return node

    def set_args(self, node: Node, values: dict[str, Any]) -> None:
        """Replace `node`'s arguments by schema name (see `replaced_args`)."""
        node.args, node.kwargs = replaced_args(node, values)

    # ---- replacing and erasing ---------------------------------------------------------------

    def replace(self, node: Node, value: Node) -> None:
        """Every use of `node` reads `value` instead; `node` is erased."""
        node.replace_all_uses_with(value)
        self.graph.erase_node(node)

    def erase(self, node: Node) -> None:
        self.graph.erase_node(node)

    def erase_dead(self, node: object) -> None:
        """Erase `node` if it is an op nothing uses any more, then its inputs likewise."""
        if isinstance(node, Node) and node.op == "call_function" and not node.users:
            inputs = node.all_input_nodes
            self.graph.erase_node(node)
            for value in inputs:
                self.erase_dead(value)

    # ---- patterns ----------------------------------------------------------------------------

    def apply(
        self, patterns: tuple[Pattern, ...], max_sweeps: int = 100
    ) -> tuple[Counter[str], bool]:
        """Apply `patterns` in place to every live call_function node until none matches (first
        matching pattern wins). A match is applied only when an existing replacement value
        records the node's type (`meta["tensor"]`). Replaced nodes are erased; their inputs may
        become dead (run dead-code removal after). Returns (matches per pattern, whether a
        fixed point was reached)."""
        counts: Counter[str] = Counter()
        for _ in range(max_sweeps):
            changed = False
            for node in list(self.graph.nodes):
                if node.op != "call_function" or not node.users:  # dead ops: left to dce
                    continue
                for pattern in patterns:
                    if self._substitute(node, pattern.match(node)):
                        counts[pattern.name] += 1
                        changed = True
                        break
            if not changed:
                return counts, True
        return counts, False

    def _substitute(self, node: Node, replacement: Replacement | None) -> bool:
        if replacement is None:
            return False
        if isinstance(replacement, NewNode):
            target, args, kwargs = replacement.target, replacement.args, replacement.kwargs
            with self.graph.inserting_before(node):
                new = self.graph.create_node(
                    "call_function", target, args, kwargs, name=short_name(target)
                )
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")})
        else:
            new = replacement
            if new.meta.get("tensor") != node.meta.get("tensor"):
                return False
        self.replace(node, new)
        return True


# ---- fake values -------------------------------------------------------------------------------


def replaced_args(node: Node, values: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`node`'s args and kwargs with the arguments named in `values` (schema names, see
    `portable.opset.bind`) replaced where the call holds them: an argument passed by position
    stays positional, the others (keywords, defaults) become keywords. `node` is unchanged."""
    if not isinstance(node.target, torch._ops.OpOverload):
        raise OperandError(f"node {node.name} ({node.target}) has no op schema to replace by name")
    positional = [a.name for a in node.target._schema.arguments if not a.kwarg_only]
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, value in values.items():
        i = positional.index(name) if name in positional else len(args)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def fake_value(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], fake: FakePolicy = "inputs"
) -> Any:
    """`target` applied to fakes of its inputs, by policy (see the module docstring); None
    under `fake="available"` when an input node has no fake value."""
    if fake == "specs":
        mode = FakeTensorMode()
        fargs = torch.fx.node.map_arg(args, lambda a: _fresh_fake(a, mode))
        with mode:
            return target(*fargs, **kwargs)
    vals = [a.meta.get("val") if isinstance(a, Node) else a for a in args]
    missing = any(isinstance(a, Node) and v is None for a, v in zip(args, vals, strict=True))
    if fake == "available" and missing:
        return None
    if target is operator.getitem:
        whole, index = vals
        if whole is None:
            raise ValueError(f"getitem of %{args[0]}, which has no fake value (meta['val'])")
        return whole[index]
    existing = next((v for v in vals if isinstance(v, FakeTensor)), None)
    if existing is None:
        if fake == "available":
            return None
        vals = [_fake_from_spec(a) if isinstance(a, Node) else a for a in args]
        return target(*vals, **kwargs)
    with existing.fake_mode:
        vals = [
            _fake_from_spec(a, existing.fake_mode) if isinstance(a, Node) and v is None else v
            for a, v in zip(args, vals, strict=True)
        ]
        return target(*vals, **kwargs)


def _fake_from_spec(node: Node, mode: FakeTensorMode | None = None) -> Any:
    """A meta tensor of `node`'s TensorSpec, converted into `mode` when one is given."""
    spec = node.meta["tensor"]
    t = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    return mode.from_tensor(t) if mode is not None else t


def _fresh_fake(node: Node, mode: FakeTensorMode) -> Any:
    """A contiguous fake CPU tensor of `node`'s TensorSpec, made in `mode`."""
    spec = node.meta["tensor"]
    with mode:
        return torch.empty(tuple(int(s) for s in spec.shape), dtype=spec.dtype)


def _spec_of(val: Any) -> Any:
    if val is None:
        return None
    if isinstance(val, tuple | list):
        return tuple(TensorSpec.of(v) for v in val)
    return TensorSpec.of(val)
