"""Recompose backward formulas that AOT autograd expands but eager autograd runs as one kernel.

The joint graph gets some derivatives through their composite (math) form, while eager
`loss.backward()` calls the fused ATen kernel. Both are correct but round differently, and an
optimizer like AdamW amplifies last-bit differences of near-zero gradients. Folding the math form
back into the kernel keeps `cpu` execution of a training step equal to eager PyTorch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx
from torch.fx.node import Argument

from ..opset.bind import bind

aten = torch.ops.aten

# A match: the fused kernel and its arguments, to call in place of the matched node.
Match = tuple[torch._ops.OpOverload, tuple[Argument, ...]]


def _call(value: object, target: torch._ops.OpOverload) -> torch.fx.Node | None:
    """`value` when it is a call of `target`, else None."""
    if isinstance(value, torch.fx.Node) and value.op == "call_function" and value.target is target:
        return value
    return None


def _ones_like(value: object) -> bool:
    full = _call(value, aten.full_like.default)
    return full is not None and bind(full).get("fill_value") == 1


def _silu_backward(node: torch.fx.Node) -> Match | None:
    # grad * (sigmoid(x) * ((x * (1 - sigmoid(x))) + 1))  ->  silu_backward(grad, x)
    # (ATen's math_silu_backward, with 1 - s written as full_like(s', 1) - s)
    if _call(node, aten.mul.Tensor) is None:
        return None
    b = bind(node)
    factors = (b.get("self"), b.get("other"))
    for grad, rest in (factors, factors[::-1]):
        rest_mul = _call(rest, aten.mul.Tensor)
        if rest_mul is None:
            continue
        r = bind(rest_mul)
        sig = _call(r.get("self"), aten.sigmoid.default)
        inner = _call(r.get("other"), aten.add.Scalar)
        if sig is None or inner is None:
            continue
        i = bind(inner)
        if i.get("other") != 1:
            continue
        prod = _call(i.get("self"), aten.mul.Tensor)
        if prod is None:
            continue
        p = bind(prod)
        x, one_minus = p.get("self"), _call(p.get("other"), aten.sub.Tensor)
        if one_minus is None:
            continue
        s = bind(one_minus)
        if not (_ones_like(s.get("self")) and s.get("other") is sig and bind(sig).get("self") is x):
            continue
        return aten.silu_backward.default, (grad, x)
    return None


PATTERNS: dict[str, Callable[[torch.fx.Node], Match | None]] = {"silu_backward": _silu_backward}


def recompose(gm: torch.fx.GraphModule) -> dict[str, int]:
    """Apply PATTERNS in place; returns match counts per pattern."""
    counts = dict.fromkeys(PATTERNS, 0)
    for node in list(gm.graph.nodes):
        for name, pattern in PATTERNS.items():
            match = pattern(node)
            if match is None:
                continue
            target, args = match
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(target, args)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            counts[name] += 1
            break
    if any(counts.values()):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return counts
