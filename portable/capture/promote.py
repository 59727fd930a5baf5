"""Type promotion as eager does it, made explicit in the graph.

Eager PyTorch computes a floating-point op (`sin`, `exp`, `sigmoid`, `mean`, ...) on an integer
or bool tensor in the result's float dtype: `torch.sin(int64)` is `torch.sin(x.float())`. The
opset declares such ops on float inputs only, so capture spells the promotion out: each integer
or bool tensor operand of a float-only *elementwise* op whose result is a float gets a `_to_copy`
to that dtype in front of it (other float ops take integer operands that are indices, as the
target of `nll_loss` or the indices of `embedding_dense_backward`, and eager does not promote
those) (exact: the same conversion eager runs first). And bool arithmetic that eager
defines as logic becomes the logical op: `add`/`maximum` of bools is `logical_or`, `minimum` is
`logical_and`; bool comparisons, max / min reductions, sign, clamps, fmax / fmin, powers and
scatter_add compute on int32 0 / 1 (cast back to bool where the result is), and numeric ops of
bools with a float result (`div`, `mul(bool, 0.5)`) take their bools cast to that float.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..opset import lookup
from ..opset.entry import NUMERIC
from ..opset.table import ELEMENTWISE, FLOAT

__all__ = ["promote_operands"]

aten = torch.ops.aten

# numeric ops eager also defines on bools, computed exactly on 0 / 1 as int32: comparisons keep
# their bool result; the others' int32 result is cast back to bool (nonzero is True: max, min,
# sign, clamp, powers and sums of 0 / 1 are what bool max / min / or give)
_BOOL_COMPARISONS = frozenset(
    getattr(getattr(aten, name), overload)
    for name in ("lt", "le", "gt", "ge")
    for overload in ("Scalar", "Tensor")
)
_BOOL_AS_INT = frozenset(
    {
        aten.amax.default,
        aten.amin.default,
        aten.sign.default,
        aten.clamp.default,
        aten.clamp.Tensor,
        aten.clamp_min.default,
        aten.clamp_max.default,
        aten.fmax.default,
        aten.fmin.default,
        aten.pow.Tensor_Scalar,
        aten.scatter_add.default,
    }
)

# (values, indices) ops eager defines on bools: values computed as int32 0 / 1, cast back
_BOOL_PAIRS = frozenset({aten.cummax.default, aten.cummin.default, aten.mode.default})

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
            changed |= _bool_values_and_indices(node)
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
        if entry is not None and _bool_operands(node, entry, out):
            changed = True
            continue
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


def _bool_operands(node: torch.fx.Node, entry: object, out: torch.Tensor) -> bool:
    """Bool operands of a numeric op eager computes on bools, spelled in dtypes the op declares:
    cast to a non-bool result's dtype (`div` of bools, `mul(bool, 0.5)`, `bool ** 2`), or
    computed as int32 0 / 1 (`_BOOL_COMPARISONS`; `_BOOL_AS_INT`, whose int32 result is cast
    back to bool). Whether it rewrote the node."""
    if getattr(entry, "dtypes", None) != NUMERIC:
        return False
    tensors = [a for a in node.args if _val(a) is not None]
    first = _val(tensors[0]) if tensors else None
    if first is None or first.dtype != torch.bool:
        return False
    elementwise = entry.has(ELEMENTWISE)  # type: ignore[attr-defined]
    if out.dtype != torch.bool and not out.is_complex() and elementwise:
        wide = out.dtype  # the result's dtype, which eager computes in (bool ** 2 is int64)
    elif node.target in _BOOL_COMPARISONS or (
        node.target in _BOOL_AS_INT and out.dtype == torch.bool
    ):
        wide = torch.int32
    else:
        return False
    graph = node.graph
    for operand in node.all_input_nodes:
        val = _val(operand)
        if val is None or val.dtype != torch.bool:
            continue
        with graph.inserting_before(node):
            cast = graph.call_function(aten._to_copy.default, (operand,), {"dtype": wide})
        cast.meta = {k: v for k, v in node.meta.items() if k != "val"}
        cast.meta["val"] = aten._to_copy.default(val, dtype=wide)
        node.replace_input_with(operand, cast)
    if node.target in _BOOL_AS_INT and out.dtype == torch.bool:
        users = list(node.users)
        node.meta["val"] = aten._to_copy.default(out, dtype=wide)
        with graph.inserting_after(node):
            back = graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.bool})
        back.meta = {k: v for k, v in node.meta.items() if k != "val"}
        back.meta["val"] = out
        for user in users:
            user.replace_input_with(node, back)
    return True


def _bool_values_and_indices(node: torch.fx.Node) -> bool:
    """cummax / cummin / mode of a bool tensor: on its int32 0 / 1, the values cast back to
    bool (the indices are the same: 0 / 1 order as False / True). Whether it rewrote the
    node."""
    if node.target not in _BOOL_PAIRS or not node.args:
        return False
    x = node.args[0]
    val = _val(x)
    results = node.meta.get("val")
    if not isinstance(x, torch.fx.Node) or val is None or val.dtype != torch.bool:
        return False
    if not isinstance(results, (tuple, list)):
        return False
    graph = node.graph
    with graph.inserting_before(node):
        cast = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.int32})
    cast.meta = {k: v for k, v in node.meta.items() if k != "val"}
    cast.meta["val"] = aten._to_copy.default(val, dtype=torch.int32)
    node.replace_input_with(x, cast)
    values, *rest = results
    node.meta["val"] = (aten._to_copy.default(values, dtype=torch.int32), *rest)
    for user in list(node.users):
        if user.target is not operator.getitem or user.args[1] != 0:
            continue
        user.meta["val"] = node.meta["val"][0]
        with graph.inserting_after(user):
            back = graph.call_function(aten._to_copy.default, (user,), {"dtype": torch.bool})
        back.meta = {k: v for k, v in user.meta.items() if k != "val"}
        back.meta["val"] = values
        for consumer in list(user.users):
            if consumer is not back:
                consumer.replace_input_with(user, back)
    return True
