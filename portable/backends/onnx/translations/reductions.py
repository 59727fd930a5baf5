"""ONNX rules for the ATen reductions whose torch.onnx rules fail on edge cases: `amax` / `amin`
over every dim (`dim=[]`, which torchlib's rules cannot take), `aminmax` (no torchlib rule), and
reductions of 0-d tensors (reducing a scalar over dim 0 or -1 is the identity; ONNX's Reduce*
ops refuse an axis on a rank-0 input), and `squeeze.dims`, which torch's decompositions of those
reductions use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from onnxscript import INT64, opset23
from onnxscript.function_libs.torch_lib.ops import core

from .selection import nan_propagating, var_mean

__all__ = ["TRANSLATIONS"]

# the ONNX ops, untyped: onnxscript types each op's inputs with type variables over every ONNX
# type, which the values a rule traces (typed when the exporter runs it) cannot be checked against
op: Any = opset23

_ATEN = torch.ops.aten


def _rank(x) -> int | None:
    shape = getattr(x, "shape", None)
    return None if shape is None else len(shape)


def _axes(dim) -> list[int]:
    if dim is None:
        return []
    if isinstance(dim, int):
        return [dim]
    return [int(d) for d in dim]


def _reduce(reduce, x, dim, keepdim: bool):
    if _rank(x) == 0:
        return op.Identity(x)
    axes = _axes(dim)
    if not axes:  # every dim
        return reduce(x, keepdims=int(bool(keepdim)))
    return reduce(x, cast(INT64, op.Constant(value_ints=axes)), keepdims=int(bool(keepdim)))


def _extreme(reduce, x, dim, keepdim: bool):
    """ReduceMax / ReduceMin, with NaN where a float x has one (ONNX Runtime's kernels skip
    NaN; torch propagates it)."""
    reduced = _reduce(reduce, x, dim, keepdim)
    rank = _rank(x) or 0
    if rank == 0 or x.dtype is None or not x.dtype.is_floating_point():
        return reduced
    axes = _axes(dim) or list(range(rank))
    return nan_propagating(reduced, x, [a % rank for a in axes], keepdim)


def amax(x, dim=(), keepdim: bool = False):
    return _extreme(op.ReduceMax, x, dim, keepdim)


def amin(x, dim=(), keepdim: bool = False):
    return _extreme(op.ReduceMin, x, dim, keepdim)


def aminmax(x, dim=None, keepdim: bool = False):
    return _extreme(op.ReduceMin, x, dim, keepdim), _extreme(op.ReduceMax, x, dim, keepdim)


def mean_dim(x, dim=None, keepdim: bool = False, dtype=None):
    if _rank(x) != 0:
        return core.aten_mean_dim(x, _axes_value(x, dim), keepdim, -1 if dtype is None else dtype)
    result = op.Identity(x)
    return result if dtype in (None, -1) else op.Cast(result, to=dtype)


def logsumexp(x, dim, keepdim: bool = False):
    if _rank(x) != 0:
        return core.aten_logsumexp(x, _axes_value(x, dim), keepdim)
    return op.Identity(x)


def var_correction(x, dim=None, correction=None, keepdim: bool = False):
    """The variance of `var_mean` (its rule divides by max(0, n - correction), computes a
    16-bit x in float32 with the correction unrounded, and takes 0-d inputs); torchlib's
    rounds the correction to a half input's type and has no rule for a bfloat16 var over all
    dims."""
    return var_mean(x, dim, correction, keepdim)[0]


def var_default(x, unbiased: bool = True):
    """What torch.export retraces a var.correction over all dims with the default correction
    as (torchlib has no rule for it on bfloat16)."""
    return var_mean(x, None, 1.0 if unbiased else 0.0, False)[0]


def squeeze_dims(x, dim):
    """torch squeezes only the named dims of size 1 (a 0-d tensor stays as is); ONNX Squeeze
    refuses any other. torchlib has no rule for this overload (its decomposition fails on 0-d)."""
    rank = _rank(x) or 0
    shape = x.shape
    axes = [
        d % rank for d in _axes(dim) if rank and not (isinstance(shape[d], int) and shape[d] != 1)
    ]
    if not axes:
        return op.Identity(x)
    return op.Squeeze(x, cast(INT64, op.Constant(value_ints=sorted(set(axes)))))


def _axes_value(x, dim):
    axes = _axes(dim) or list(range(_rank(x) or 0))
    return cast(INT64, op.Constant(value_ints=axes))


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _ATEN.amax.default: amax,
    _ATEN.amin.default: amin,
    _ATEN.aminmax.default: aminmax,
    _ATEN.mean.dim: mean_dim,
    _ATEN.logsumexp.default: logsumexp,
    _ATEN.squeeze.dims: squeeze_dims,
    _ATEN.var.correction: var_correction,
    _ATEN.var.default: var_default,
}
