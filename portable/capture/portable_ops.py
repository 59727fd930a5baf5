"""Rewrite the composite ATen ops that the opset keeps whole into `portable::` ops.

Runs on torch.export's training IR, where composite ops such as
`aten.scaled_dot_product_attention` are still single nodes, before decomposition to core ATen.
The portable ops carry autograd formulas, so the joint (training) graph gets their backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import (
    optimization_hint,
    statically_known_true,
    sym_eq,
)
from torch.fx.node import Argument

from ..errors import CaptureError
from ..ir.source import SourceLoc
from ..opset.bind import bind
from ..opset.nn_ops import attention_strides

aten = torch.ops.aten
portable_ops = torch.ops.portable

# A rule's result: the portable op, its positional arguments and its keyword arguments.
Rewrite = tuple[torch._ops.OpOverload, tuple[Argument, ...], dict[str, Argument]]


def _sdpa(node: torch.fx.Node, src: SourceLoc | None) -> Rewrite:
    # aten.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
    #                                   scale=None, enable_gqa=False)
    b = bind(node)
    dropout = b.literal("dropout_p")
    if dropout not in (0, 0.0):
        # reachable where capture's counter-based dropout (capture/dropout.py) did not run or
        # did not see the call: inference capture, or SDPA inside another torch function
        raise CaptureError(
            f"attention dropout (dropout_p={dropout}) reached the graph as torch's random draw, "
            "which no backend reproduces",
            op="aten.scaled_dot_product_attention",
            module=src.module if src else None,
            source=src.location() if src else None,
            fix="for inference pass dropout_p=0.0 (model.eval()); a training capture draws "
            "the mask from the program's counter-based generator when the model itself calls "
            "F.scaled_dot_product_attention (not from inside another torch function)",
        )
    args = (
        b.node("query"),
        b.node("key"),
        b.node("value"),
        b.optional_node("attn_mask"),
        bool(b.literal("is_causal")),
        b.get("scale"),  # a float, or a node when computed from a dynamic size
    )
    return portable_ops.attention.default, args, {}


def _layer_norm(node: torch.fx.Node, src: SourceLoc | None) -> Rewrite:
    # aten.layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True)
    b = bind(node)
    args = (
        b.node("input"),
        list(b.literal("normalized_shape")),
        b.optional_node("weight"),
        b.optional_node("bias"),
        float(b.literal("eps")),
    )
    return portable_ops.layer_norm.default, args, {}


def _rms_norm(node: torch.fx.Node, src: SourceLoc | None) -> Rewrite:
    # aten.rms_norm(input, normalized_shape, weight=None, eps=None)
    b = bind(node)
    args = (
        b.node("input"),
        list(b.literal("normalized_shape")),
        b.optional_node("weight"),
        b.get("eps"),
    )
    return portable_ops.rms_norm.default, args, {}


REWRITES: dict[object, Callable[[torch.fx.Node, SourceLoc | None], Rewrite]] = {
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.layer_norm.default: _layer_norm,
    aten.rms_norm.default: _rms_norm,
}


def rewrite_to_portable_ops(
    gm: torch.fx.GraphModule, source_of: Callable[[torch.fx.Node], SourceLoc | None]
) -> int:
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


def _keep_traced_layout(
    graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node
) -> torch.fx.Node:
    """`new` in the layout torch.export traced for `old`, which later views may rely on.

    Only attention can differ: its layout is that of SDPA on CPU for inputs that do not require
    grad, and SDPA takes its unfused path (a row-major result) when the mask requires grad. Then
    # out = permute(clone(permute(new, p), contiguous), p^-1)   (p: the traced dims, outer first)
    gives the traced layout exactly."""
    traced = old.meta.get("val")
    if new.target is not portable_ops.attention.default or not isinstance(traced, torch.Tensor):
        return new
    # the fake values of attention's arguments, by its schema names (attention_strides's too)
    vals: dict[str, Any] = {
        name: value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        for name, value in bind(new).items()
    }
    if _same_strides(attention_strides(**vals), traced.stride()):
        return new
    order = _dim_order(traced)
    in_order = order == sorted(order)
    x = new if in_order else _call(graph, aten.permute.default, new, order)
    x = _call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
    inverse = [order.index(d) for d in range(len(order))]
    return x if in_order else _call(graph, aten.permute.default, x, inverse)


def _call(
    graph: torch.fx.Graph,
    target: torch._ops.OpOverload,
    x: torch.fx.Node,
    *args: Argument,
    **kwargs: Argument,
) -> torch.fx.Node:
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
