"""The fake value of every node, derived from what a program archive stores.

The cuda backend plans each Triton launch from its operands' shapes and dtypes, and decides
rewrites (GQA, native MX matmuls) from shapes. A freshly captured program carries torch.export's
fake tensors in `node.meta["val"]`; a loaded one does not (the archive stores `meta["tensor"]`,
a `TensorSpec`, and `meta["source"]`). So the backend never reads capture-time values: it runs
the ops' fake kernels over its own copy of the graph, from the placeholders' recorded specs,
and writes the result into that copy's `meta["val"]`. A program lowers the same whether it was
captured a moment ago or loaded from an archive.

A dynamic dim (a symbol of `metadata["symbolic_dims"]`) is planned at `planning_size` of its
declared range, the size the `.pt2` is traced at too.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from portable.errors import LoweringError
from portable.ir.program import Program
from portable.ir.signature import TensorSpec
from portable.ir.source import source_of
from portable.opset.bind import bind

__all__ = ["annotate_fake_values", "concrete_shape", "planning_size"]


def planning_size(bounds: Mapping[str, Any] | None) -> int:
    """The size a dynamic dim with `bounds` ({"min", "max"}; max None when unbounded) is planned
    and traced at: 4, moved into the range."""
    bounds = bounds or {}
    size = max(bounds.get("min", 2), 4)
    high = bounds.get("max")
    return min(size, high) if high else size


def concrete_shape(spec: TensorSpec, symbols: Mapping[str, Any]) -> tuple[int, ...]:
    """`spec`'s shape with each symbol at its planning size (LoweringError for a dim that is an
    expression of symbols rather than one: placeholders are sized by plain symbols)."""
    shape = []
    for dim in spec.shape:
        if isinstance(dim, int):
            shape.append(dim)
        elif dim in symbols:
            shape.append(planning_size(symbols[dim]))
        else:
            raise LoweringError(
                f"input dim {dim!r} is not a declared symbolic dim "
                f"(declared: {', '.join(sorted(symbols)) or 'none'})",
                backend="cuda",
                fix="capture with dynamic_shapes naming each dynamic input dim, or with static shapes",
            )
    return tuple(shape)


def annotate_fake_values(gm: torch.fx.GraphModule, program: Program) -> None:
    """Set `meta["val"]` of every placeholder and call of `gm` (a copy of `program`'s graph, or a
    rewrite of it) by running the fake kernels from the placeholders' `meta["tensor"]`."""
    symbols = program.metadata.get("symbolic_dims", {})
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            with mode:
                node.meta["val"] = torch.empty(
                    concrete_shape(node.meta["tensor"], symbols), dtype=node.meta["tensor"].dtype
                )
        elif node.op == "call_function":
            node.meta["val"] = _fake_call(node, mode)


def _fake_call(node: torch.fx.Node, mode: FakeTensorMode) -> Any:
    if node.target is operator.getitem:  # an element of a tuple-valued op's fake value
        item = bind(node)
        return item.node("self").meta["val"][item.literal("index")]
    target = node.target
    assert callable(target), "a call_function node calls its target"
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    try:
        with mode:
            return target(*args, **kwargs)
    except Exception as exc:  # a fake kernel rejecting its inputs: the op's own error text
        src = source_of(node)
        raise LoweringError(
            f"cannot derive the shape of {node.name} from the program's recorded shapes: {exc}",
            backend="cuda",
            op=str(node.target),
            module=src.module if src else None,
            source=src.location() if src else None,
            fix="run `portable.verify` on the program; a program that verifies lowers here",
        ) from exc
