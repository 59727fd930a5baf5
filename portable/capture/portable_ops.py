"""Rewrite the composite ATen ops that the opset keeps whole into `portable::` ops.

Runs on torch.export's training IR, where composite ops such as
`aten.scaled_dot_product_attention` are still single nodes, before decomposition to core ATen.
The portable ops carry autograd formulas, so the joint (training) graph gets their backward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import (
    optimization_hint,
    statically_known_true,
    sym_eq,
)

from ..errors import CaptureError
from ..ir.source import SourceLoc
from ..opset.nn_ops import attention_strides

aten = torch.ops.aten
portable_ops = torch.ops.portable


def _sdpa(node: torch.fx.Node, src: SourceLoc | None):
    # aten.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
    #                                   scale=None, enable_gqa=False)
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    values = dict(zip(names, defaults, strict=True))
    values.update(zip(names, node.args, strict=False))
    values.update(node.kwargs)
    if values["dropout_p"] not in (0, 0.0):
        raise CaptureError(
            f"attention dropout (dropout_p={values['dropout_p']}) is random and cannot be compared "
            "across backends",
            op="aten.scaled_dot_product_attention",
            module=src.module if src else None,
            source=src.location() if src else None,
            fix="capture with dropout_p=0.0 (model.eval() for inference, or set attention dropout to 0)",
        )
    args = (
        values["query"],
        values["key"],
        values["value"],
        values["attn_mask"],
        bool(values["is_causal"]),
        values["scale"],
    )
    return portable_ops.attention.default, args, {}


def _layer_norm(node: torch.fx.Node, src):
    # aten.layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True)
    a = list(node.args) + [None] * (6 - len(node.args))
    eps = node.kwargs.get("eps", a[4] if a[4] is not None else 1e-5)
    weight = node.kwargs.get("weight", a[2])
    bias = node.kwargs.get("bias", a[3])
    return portable_ops.layer_norm.default, (a[0], list(a[1]), weight, bias, float(eps)), {}


def _rms_norm(node: torch.fx.Node, src):
    # aten.rms_norm(input, normalized_shape, weight=None, eps=None)
    a = list(node.args) + [None] * (4 - len(node.args))
    weight = node.kwargs.get("weight", a[2])
    eps = node.kwargs.get("eps", a[3])
    return portable_ops.rms_norm.default, (a[0], list(a[1]), weight, eps), {}


REWRITES: dict[object, Callable] = {
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _rms_norm,
}


def rewrite_to_portable_ops(gm: torch.fx.GraphModule, source_of) -> int:
    """Replace each REWRITES op in `gm` in place; returns the number of nodes rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        rule = REWRITES.get(node.target) if node.op == "call_function" else None
        if rule is None:
            continue
        target, args, kwargs = rule(node, source_of(node))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, args, kwargs)
            new.meta = dict(node.meta)
            out = _keep_traced_layout(gm.graph, node, new)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


def _keep_traced_layout(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node):
    """`new` in the layout torch.export traced for `old`, which later views may rely on.

    Only attention can differ: its layout is that of SDPA on CPU for inputs that do not require
    grad, and SDPA takes its unfused path (a row-major result) when the mask requires grad. Then
    # out = permute(clone(permute(new, p), contiguous), p^-1)   (p: the traced dims, outer first)
    gives the traced layout exactly."""
    traced = old.meta.get("val")
    if new.target is not portable_ops.attention.default or not isinstance(traced, torch.Tensor):
        return new
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in new.args]
    if _same_strides(attention_strides(*vals), traced.stride()):
        return new
    order = _dim_order(traced)
    in_order = order == sorted(order)
    x = new if in_order else _call(graph, aten.permute.default, new, order)
    x = _call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
    inverse = [order.index(d) for d in range(len(order))]
    return x if in_order else _call(graph, aten.permute.default, x, inverse)


def _call(graph: torch.fx.Graph, target, x: torch.fx.Node, *args, **kwargs) -> torch.fx.Node:
    """target(x, *args, **kwargs) at the insertion point, with x's meta but no fake value (the
    decomposition that follows retraces)."""
    node = graph.call_function(target, (x, *args), kwargs)
    node.meta = {k: v for k, v in x.meta.items() if k != "val"}
    return node


def _same_strides(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        statically_known_true(sym_eq(x, y)) for x, y in zip(a, b, strict=True)
    )


def _dim_order(t: torch.Tensor) -> list[int]:
    """t's dims from outermost to innermost in memory (ties, from size-1 dims, in dim order)."""
    return sorted(range(t.dim()), key=lambda d: (-optimization_hint(t.stride()[d]), d))
