"""Where a pipeline's stages begin when the plan names no split points: the model's repeated
layers (`blocks.N`, `model.layers.N`), grouped contiguously so that the largest group's counted
work (2mnk per matmul, elements per other op) is as small as possible."""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Sequence

import torch
import torch.fx

from ..errors import PlanError
from ..ir.signature import TensorSpec

__all__ = ["balance", "flops", "layer_modules", "tensor_of"]

aten = torch.ops.aten


_LAYER = re.compile(r"(.*?\.?[A-Za-z_]\w*)\.(\d+)(?:\.|$)")


def layer_modules(modules: Sequence[str]) -> list[str]:
    """The model's repeated layers in forward order (`blocks.0`, `blocks.1`, ...): the children
    of the module list with the most numbered children among `modules`."""
    children: dict[str, list[str]] = {}
    for path in modules:
        match = _LAYER.match(path)
        if match:
            layer = f"{match.group(1)}.{match.group(2)}"
            seen = children.setdefault(match.group(1), [])
            if layer not in seen:
                seen.append(layer)
    if not children:
        return []
    return max(children.values(), key=len)


def tensor_of(node: torch.fx.Node) -> TensorSpec | None:
    """A node's static shape and dtype (None for a tuple-valued op)."""
    spec = node.meta.get("tensor")
    if isinstance(spec, TensorSpec):
        return spec
    val = node.meta.get("val")
    return TensorSpec.of(val) if isinstance(val, torch.Tensor) else None


def _numel(spec: TensorSpec) -> int:
    return math.prod(d if isinstance(d, int) else 1 for d in spec.shape)


def flops(node: torch.fx.Node) -> float:
    """A node's counted work: 2mnk for a matmul, else its output's elements."""
    out = tensor_of(node)
    if out is None:
        return 0.0
    if node.target in (aten.mm.default, aten.bmm.default, aten.addmm.default):
        a = tensor_of(typing.cast(torch.fx.Node, node.args[-2]))
        if a is not None and isinstance(a.shape[-1], int):
            return 2.0 * _numel(out) * a.shape[-1]
    return float(_numel(out))


def balance(costs: Sequence[float], parts: int) -> list[int]:
    """Start indices of `parts` contiguous groups of `costs` minimizing the largest group's sum
    (group 0 starts at 0)."""
    n = len(costs)
    if parts > n:
        raise PlanError(f"{parts} stages need at least {parts} layers; the model has {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]
