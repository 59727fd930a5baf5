"""Type promotion as eager does it, made explicit in the graph.

Eager PyTorch computes a floating-point op (`sin`, `exp`, `sigmoid`, `mean`, ...) on an integer
or bool tensor in the result's float dtype: `torch.sin(int64)` is `torch.sin(x.float())`. The
opset declares such ops on float inputs only, so capture spells the promotion out: each integer
or bool tensor operand of a float-only *elementwise* op whose result is a float gets a `_to_copy`
to that dtype in front of it (other float ops take integer operands that are indices, as the
target of `nll_loss` or the indices of `embedding_dense_backward`, and eager does not promote
those) (exact: the same conversion eager runs first). And bool arithmetic that eager
defines as logic becomes the logical op: `add`/`maximum` of bools is `logical_or`, `minimum` is
`logical_and`.
"""

from __future__ import annotations

import torch
import torch.fx

from ..opset import lookup
from ..opset.table import ELEMENTWISE, FLOAT

__all__ = ["promote_operands"]

aten = torch.ops.aten

_BOOL_LOGIC = {
    aten.add.Tensor: aten.logical_or.default,
    aten.maximum.default: aten.logical_or.default,
    aten.minimum.default: aten.logical_and.default,
}


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def promote_operands(gm: torch.fx.GraphModule) -> None:
    """Insert eager's implicit casts before float-only ops; bool add/max/min as logic."""
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        out = _val(node)
        if out is None:
            continue
        if (
            node.target in _BOOL_LOGIC
            and out.dtype == torch.bool
            and node.kwargs.get("alpha", 1) == 1  # add(b, c, alpha=False) is b: left as is
        ):
            operands = list(node.args[:2])
            if all(getattr(_val(a), "dtype", None) == torch.bool for a in operands):
                node.target = _BOOL_LOGIC[node.target]
                node.args, node.kwargs = tuple(operands), {}
                changed = True
            continue
        entry = lookup(node.target)
        if (
            entry is None
            or entry.dtypes != FLOAT
            or not entry.has(ELEMENTWISE)  # index operands (gather, nll_loss target) stay ints
            or not out.is_floating_point()
        ):
            continue
        for operand in list(node.all_input_nodes):
            val = _val(operand)
            if val is None or val.is_floating_point() or val.is_complex():
                continue
            with graph.inserting_before(node):
                cast = graph.call_function(aten._to_copy.default, (operand,), {"dtype": out.dtype})
            cast.meta = {k: v for k, v in node.meta.items() if k != "val"}
            cast.meta["val"] = aten._to_copy.default(val, dtype=out.dtype)
            node.replace_input_with(operand, cast)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
