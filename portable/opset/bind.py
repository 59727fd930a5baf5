"""Named op arguments: `bind(node)` reads a call node's arguments by their schema names.

A pass or lowering rule never reads `node.args[2]`: it binds the node and asks for `weight`.
Binding follows the op's registered schema (`target._schema.arguments`): positional arguments
in order, then keywords, then the schema's defaults. Python callables that stand in for ops
(`operator.getitem` on tuple results, the `sym.*` size arithmetic) have fixed names.

Values are typed apart: `bound.node("weight")` returns a `torch.fx.Node` or raises
`OperandError` (a literal where a tensor operand was expected); `bound.literal("dim")` the
reverse; `bound.weight` / `bound["weight"]` / `bound.get("bias")` return whichever is there.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import PortableError

# Argument names of the Python callables that appear as node targets in portable programs.
_PYTHON_SIGNATURES: dict[Any, tuple[str, ...]] = {
    operator.getitem: ("self", "index"),
    operator.add: ("a", "b"),
    operator.sub: ("a", "b"),
    operator.mul: ("a", "b"),
    operator.floordiv: ("a", "b"),
    operator.mod: ("a", "b"),
}


class OperandError(PortableError):
    """A node's argument is not what the reader expected (a literal for a tensor operand, an
    unknown argument name, a target without a schema)."""


def _schema_values(node: torch.fx.Node) -> dict[str, Any]:
    values: dict[str, Any] = {}
    positional = 0
    for arg in node.target._schema.arguments:  # type: ignore[union-attr]
        if not arg.kwarg_only and positional < len(node.args):
            values[arg.name] = node.args[positional]
            positional += 1
        elif arg.name in node.kwargs:
            values[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            values[arg.name] = arg.default_value
    return values


def _python_values(node: torch.fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    values = dict(zip(names, node.args, strict=False))
    values.update({k: v for k, v in node.kwargs.items() if k in names})
    return values


def arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, in schema order, defaults filled in. Raises
    `OperandError` for a target that is neither a torch op overload nor a known callable."""
    if isinstance(node.target, torch._ops.OpOverload):
        return _schema_values(node)
    names = _PYTHON_SIGNATURES.get(node.target)
    if names is None:
        raise OperandError(f"node {node.name} ({node.op} {node.target}) has no op schema to bind")
    return _python_values(node, names)


class Bound(Mapping[str, Any]):
    """A call node's arguments by name (read-only). Attribute access reads an argument; an
    unknown name raises `OperandError` naming the op's argument names."""

    __slots__ = ("_node", "_values")

    def __init__(self, node: torch.fx.Node, values: dict[str, Any]) -> None:
        self._node = node
        self._values = values

    def __getitem__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise OperandError(
                f"{self._node.name} ({self._node.target}) has no argument {name!r}; it has "
                f"{', '.join(self._values) or 'none'}"
            ) from None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def get(self, name: str, default: Any = None) -> Any:
        """The argument `name`, or `default` when the op has no such argument."""
        return self._values.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def node(self, name: str) -> torch.fx.Node:
        """The argument `name` as a graph node; `OperandError` when it is a literal."""
        value = self[name]
        if not isinstance(value, torch.fx.Node):
            raise OperandError(
                f"{self._node.name} ({self._node.target}): argument {name} is the literal "
                f"{value!r}, not a tensor operand"
            )
        return value

    def optional_node(self, name: str) -> torch.fx.Node | None:
        """The argument `name` as a graph node, or None when it is absent or None."""
        value = self._values.get(name)
        return None if value is None else self.node(name)

    def literal(self, name: str) -> Any:
        """The argument `name` as a literal (a Python value); `OperandError` when it is a node."""
        value = self[name]
        if isinstance(value, torch.fx.Node):
            raise OperandError(
                f"{self._node.name} ({self._node.target}): argument {name} is the node "
                f"{value.name}, not a literal"
            )
        return value


def bind(node: torch.fx.Node) -> Bound:
    """`node`'s arguments by name (see the module docstring)."""
    return Bound(node, arguments(node))
