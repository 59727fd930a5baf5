"""ONNX rules for the opset family `special` (portable/opset/families/special.py); the ops it has no
rule for are refused by capability (backends/onnx/unsupported.py). ldexp is torchlib's (x times
Pow(2, other), as torch computes it); angle is here because torchlib's turns NaN into 0."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from onnxscript import ir, opset23

__all__ = ["TRANSLATIONS"]

# untyped, as in translations/math.py: onnxscript's type variables do not check traced values
op: Any = opset23


def _angle(x):
    # torch's real angle: NaN stays NaN, pi below 0, else 0 (-0.0 included); capture has cast
    # integer inputs to the float result already
    dtype = x.dtype if x.dtype is not None else ir.DataType.FLOAT
    pi = op.Constant(value=ir.tensor(math.pi, dtype=dtype))
    zero = op.Constant(value=ir.tensor(0.0, dtype=dtype))
    y = op.Where(op.Less(x, zero), pi, zero)
    return op.Where(op.IsNaN(x), x, y)


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    torch.ops.aten.angle.default: _angle,
}
