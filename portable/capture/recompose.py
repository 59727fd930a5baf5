"""Recompose backward formulas that AOT autograd expands but eager autograd runs as one kernel.

The joint graph gets some derivatives through their composite (math) form, while eager
`loss.backward()` calls the fused ATen kernel. Both are correct but round differently, and an
optimizer like AdamW amplifies last-bit differences of near-zero gradients. Folding the math form
back into the kernel keeps `cpu` execution of a training step equal to eager PyTorch.
"""

from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _ones_like(node) -> bool:
    return _is(node, aten.full_like.default) and node.args[1] == 1


def _silu_backward(node: torch.fx.Node):
    # grad * (sigmoid(x) * ((x * (1 - sigmoid(x))) + 1))  ->  silu_backward(grad, x)
    # (ATen's math_silu_backward, with 1 - s written as full_like(s', 1) - s)
    if not _is(node, aten.mul.Tensor):
        return None
    for grad, rest in (node.args, reversed(node.args)):
        if not _is(rest, aten.mul.Tensor):
            continue
        sig, inner = rest.args
        if not (
            _is(sig, aten.sigmoid.default) and _is(inner, aten.add.Scalar) and inner.args[1] == 1
        ):
            continue
        prod = inner.args[0]
        if not _is(prod, aten.mul.Tensor):
            continue
        x, one_minus = prod.args
        if not (
            _is(one_minus, aten.sub.Tensor)
            and _ones_like(one_minus.args[0])
            and one_minus.args[1] is sig
            and sig.args[0] is x
        ):
            continue
        return aten.silu_backward.default, (grad, x)
    return None


PATTERNS = {"silu_backward": _silu_backward}


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
