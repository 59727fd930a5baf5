"""ONNX rules for ATen ops whose torch.onnx translation ONNX Runtime's CPU provider cannot run
for a dtype the opset declares: integer `addmm` (Gemm is float-only: MatMul and Add instead),
integer `relu` (Relu is float-only: Max with 0), bool `where` (ORT has no bool Where: the same
selection in logic ops), `isnan` of integers and bools (IsNaN is float-only: never NaN), and
`empty_permuted` (no torchlib rule: zeros, as torchlib's `empty`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import onnx_ir as ir
import torch
from onnxscript import opset23
from onnxscript.function_libs.torch_lib.ops import common as common_ops
from onnxscript.function_libs.torch_lib.ops import core

__all__ = ["TRANSLATIONS"]

# the ONNX ops, untyped: onnxscript types each op's inputs with type variables over every ONNX
# type, which the values a rule traces (typed when the exporter runs it) cannot be checked against
op: Any = opset23

_ATEN = torch.ops.aten
_FLOATS = frozenset(
    {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
)


def _is_float(x) -> bool:
    """Whether `x` is a floating-point value (unknown dtypes count as float: torchlib's rule)."""
    dtype = getattr(x, "dtype", None)
    return dtype is None or dtype in _FLOATS


def addmm(self, mat1, mat2, beta: float = 1.0, alpha: float = 1.0):
    if _is_float(mat1):
        return core.aten_addmm(self, mat1, mat2, beta=beta, alpha=alpha)
    product = op.MatMul(mat1, mat2)
    if alpha != 1:
        product = op.Mul(product, op.CastLike(int(alpha), product))
    if beta == 0:  # torch ignores `self` when beta is 0
        return product
    bias = self if beta == 1 else op.Mul(self, op.CastLike(int(beta), self))
    return op.Add(bias, product)


def relu(self):
    if _is_float(self):
        return op.Relu(self)
    return op.Max(self, op.CastLike(0, self))


def where(condition, self, other):
    if getattr(self, "dtype", None) == ir.DataType.BOOL:
        return op.Or(op.And(condition, self), op.And(op.Not(condition), other))
    return op.Where(condition, self, other)


def isnan(self):
    if _is_float(self):
        return op.IsNaN(self)
    return op.Not(op.Equal(self, self))  # False everywhere, in the input's shape


def empty_permuted(
    size: Sequence,
    physical_layout: Sequence[int],
    dtype: int = ir.DataType.FLOAT,
    layout: str = "",
    device: str = "",
    pin_memory: bool = False,
):
    """Uninitialized memory in torch; zeros here (a program never reads it before writing)."""
    if dtype == -1:
        dtype = ir.DataType.FLOAT
    zero = op.Constant(value=ir.tensor(0, dtype=ir.DataType(dtype)))
    return op.Expand(zero, common_ops.merge_dims(size))


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _ATEN.addmm.default: addmm,
    _ATEN.relu.default: relu,
    _ATEN.where.self: where,
    _ATEN.isnan.default: isnan,
    _ATEN.empty_permuted.default: empty_permuted,
}
