"""ONNX rules for the ATen ops of reductions, sorting, selection and scans added with opset 1.3
whose torch.onnx rules are missing or wrong; the others are translated by torch.onnx's own library.

What torchlib gets wrong, and each rule here fixes:
- NaN: ONNX Runtime's ArgMin / ReduceMax / ReduceMin / TopK / ScatterElements(max) skip NaN or
  order it arbitrarily, where torch propagates it (`min`, `max`, `amax`-like norms) or treats it
  as the extreme (`argmin` and `min.dim` pick the first NaN; `sort` puts NaN last, first when
  descending). The rules mask NaN explicitly.
- 0-d inputs reduced over dim 0 or -1 (ONNX Reduce* refuse an axis on a rank-0 tensor), and
  `any.dims(x, [])`, which reduces no dim.
- missing rules: `sort.stable` and `cumprod` (torchlib has none that exports), and bool inputs
  to ArgMin / TopK (cast to int32 first).
- `scatter_reduce`: torchlib ignores `mean` (it overwrites) and passes an uncropped src.
- `var_mean` divides by n - correction even past n (torchlib scales the biased variance) and
  `linalg_vector_norm` keeps no dims for dim=None, keepdim=True.
- rounding, as torch's CPU kernels: a float16 / bfloat16 `prod` rounds to its type after each
  factor, `cumprod` accumulates half types in float32 and float32 in float64, and
  `scatter_reduce(mean)` rounds the sum before dividing. torch.onnx's type promotion hands
  `prod` and `cumprod` a float32 Cast of a half input: the rules read the Cast's source type.

The bfloat16 rewrite of export (bfloat16.py) computes each rule's values in float32 and rounds
the op's results; an explicit `Cast` to bfloat16 inside a rule rounds there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from onnxscript import BOOL, INT64, opset23

__all__ = ["TRANSLATIONS"]

# the ONNX ops, untyped: onnxscript types each op's inputs with type variables over every ONNX
# type, which the values a rule traces (typed when the exporter runs it) cannot be checked against
op: Any = opset23

_ATEN = torch.ops.aten

# ONNX type numbers (onnx.TensorProto)
_FLOAT, _INT32, _INT64, _BOOL, _UINT8, _DOUBLE = 1, 6, 7, 9, 2, 11
_HALF = {"BFLOAT16": 16, "FLOAT16": 10}
_FLOAT_TYPES = {_FLOAT, _DOUBLE, *_HALF.values()}
_TYPE = {"FLOAT": _FLOAT, "DOUBLE": _DOUBLE, **_HALF, "INT32": _INT32, "INT64": _INT64}
_TYPE |= {"BOOL": _BOOL, "UINT8": _UINT8, "INT8": 3, "INT16": 5}
_FLOATS = {"FLOAT", "DOUBLE", *_HALF}
_SMALL_INTS = {"BOOL", "UINT8", "INT8", "INT16", "INT32"}  # products and scans widen to int64
# a half-type prod / a float cumprod is a chain of this many multiplies at most; longer runs
# reduce at once (torch's CPU kernel vectorizes long prods too, in an order of its own)
_CHAIN = 256


def _rank(x: Any) -> int:
    return len(x.shape)


def _kind(x: Any) -> str:
    """The ONNX type name of a rule's input (the exporter types inputs, not the values a rule
    computes: rules read types and shapes of their inputs only)."""
    if x.dtype is None:
        raise ValueError("a value without a known dtype reached a selection rule")
    return x.dtype.name


def _is_float(x: Any) -> bool:
    return _kind(x) in _FLOATS


def _ints(values: Sequence[int]) -> INT64:
    return cast(INT64, op.Constant(value_ints=[int(v) for v in values]))


def _axes(dim: Any, rank: int) -> list[int]:
    """torch's dim argument (int, list, None) as sorted non-negative axes; None or [] is all."""
    if dim is None:
        return list(range(rank))
    dims = [dim] if isinstance(dim, int) else [int(d) for d in dim]
    return sorted({d % rank for d in dims}) if dims else list(range(rank))


def _like(value: float, x: Any) -> Any:
    return op.CastLike(op.Constant(value_float=value), x)


def _any_nan(x: Any, axes: Sequence[int], keepdim: bool) -> BOOL:
    flags = op.Cast(op.IsNaN(x), to=_INT32)
    return cast(BOOL, op.Cast(op.ReduceMax(flags, _ints(axes), keepdims=int(keepdim)), to=_BOOL))


def nan_propagating(reduced: Any, x: Any, axes: Sequence[int], keepdim: bool) -> Any:
    """`reduced` (a max / min of float x over axes), NaN where x has a NaN."""
    return op.Where(_any_nan(x, axes, keepdim), _like(math.nan, reduced), reduced)


def _out_type(x: Any, dtype: Any) -> int | None:
    """The ONNX type of a product / scan: `dtype` when given, int64 for bool and small ints."""
    if dtype is not None and dtype != -1:
        return int(dtype)
    return _INT64 if _kind(x) in _SMALL_INTS else None


# --------------------------------------------------------------------------- argmin, min, max


def _first_extreme(x: Any, kind: str, axis: int, keepdim: bool, largest: bool) -> INT64:
    """The index of the first minimum (maximum when `largest`) along axis; a NaN counts as the
    extreme either way (torch)."""
    keys = op.Cast(x, to=_INT32) if kind == "BOOL" else x
    arg = op.ArgMax if largest else op.ArgMin
    index = arg(keys, axis=axis, keepdims=int(keepdim), select_last_index=0)
    if kind not in _FLOATS:
        return cast(INT64, index)
    nan = op.Cast(op.IsNaN(x), to=_INT32)
    first_nan = op.ArgMax(nan, axis=axis, keepdims=int(keepdim), select_last_index=0)
    return cast(INT64, op.Where(_any_nan(x, [axis], keepdim), first_nan, index))


def _arg_extreme(x, dim, keepdim: bool, largest: bool):
    rank = _rank(x)
    if rank == 0:
        return op.Constant(value_int=0)
    if dim is None:  # index into the flattened tensor; keepdim keeps every dim as 1
        index = _first_extreme(op.Reshape(x, _ints([-1])), _kind(x), 0, False, largest)
        return op.Reshape(index, _ints([1] * rank)) if keepdim else index
    return _first_extreme(x, _kind(x), int(dim) % rank, keepdim, largest)


def argmin(x, dim=None, keepdim: bool = False):
    return _arg_extreme(x, dim, keepdim, largest=False)


def argmax(x, dim=None, keepdim: bool = False):
    """torchlib's ArgMax skips NaN, which torch takes as the maximum."""
    return _arg_extreme(x, dim, keepdim, largest=True)


def _dim_extreme(x, dim: int, keepdim: bool, largest: bool):
    rank = _rank(x)
    if rank == 0:
        return op.Identity(x), op.Constant(value_int=0)
    axis = int(dim) % rank
    index = _first_extreme(x, _kind(x), axis, True, largest)
    values = op.GatherElements(x, index, axis=axis)  # exactly the element the index names
    if keepdim:
        return values, index
    return op.Squeeze(values, _ints([axis])), op.Squeeze(index, _ints([axis]))


def min_dim(x, dim: int, keepdim: bool = False):
    return _dim_extreme(x, dim, keepdim, largest=False)


def max_dim(x, dim: int, keepdim: bool = False):
    """torchlib's max.dim skips NaN, which torch returns (with its index)."""
    return _dim_extreme(x, dim, keepdim, largest=True)


def _extreme(reduce: Callable, x: Any) -> Any:
    if _rank(x) == 0:
        return op.Identity(x)
    keys = op.Cast(x, to=_INT32) if _kind(x) == "BOOL" else x
    reduced = reduce(keys, keepdims=0)
    if _kind(x) == "BOOL":
        return op.Cast(reduced, to=_BOOL)
    if not _is_float(x):
        return reduced
    return nan_propagating(reduced, x, list(range(_rank(x))), False)


def max_all(x):
    return _extreme(op.ReduceMax, x)


def min_all(x):
    return _extreme(op.ReduceMin, x)


# --------------------------------------------------------------------------- any, prod


def _any(x: Any, axes: Sequence[int], keepdim: bool) -> Any:
    nonzero = x if _kind(x) == "BOOL" else op.Not(op.Equal(x, _like(0.0, x)))
    out = _UINT8 if _kind(x) == "UINT8" else _BOOL  # torch: uint8 in, uint8 out
    if not axes:
        return op.Cast(nonzero, to=out)
    flags = op.Cast(nonzero, to=_INT32)
    return op.Cast(op.ReduceMax(flags, _ints(axes), keepdims=int(keepdim)), to=out)


def any_all(x):
    return _any(x, list(range(_rank(x))), False)


def any_dim(x, dim: int, keepdim: bool = False):
    return _any(x, [int(dim) % _rank(x)] if _rank(x) else [], keepdim)


def any_dims(x, dim=None, keepdim: bool = False):
    if _rank(x) == 0 or (dim is not None and not isinstance(dim, int) and len(dim) == 0):
        return _any(x, [], keepdim)  # [] reduces no dim
    return _any(x, _axes(dim, _rank(x)), keepdim)


def _static(x: Any) -> bool:
    return all(isinstance(d, int) for d in x.shape)


def _half(x: Any, out: int | None) -> int | None:
    """The ONNX type number of a float16 / bfloat16 product: x's, the `out` it is cast to, or the
    half type torch.onnx's type-promotion pass widened x from (it hands prod and cumprod a
    float32 Cast of a half input and narrows the result again)."""
    if out is not None:
        return out if out in _HALF.values() else None
    if _kind(x) in _HALF:
        return _HALF[_kind(x)]
    producer = x.producer() if callable(getattr(x, "producer", None)) else None
    if producer is None or producer.op_type != "Cast" or not producer.inputs:
        return None
    to = producer.attributes.get("to")
    source = producer.inputs[0]
    if to is None or to.value != _FLOAT or source is None or source.dtype is None:
        return None
    return _HALF.get(source.dtype.name)


def _round_to(x: Any, half: int) -> Any:
    """x (float32) rounded to the half type and widened back: a rounding torch's kernel does."""
    return op.Cast(op.Cast(x, to=half), to=_FLOAT)


def _chain_prod(x: Any, shape: list[int], axes: list[int], keepdim: bool, half: int) -> Any:
    """prod over axes of x (of `shape`) in float32, rounded to `half` after each factor, in
    index order; the result float32."""
    rank = len(shape)
    rest = [d for d in range(rank) if d not in axes]
    sizes = [shape[d] for d in rest]
    rows = op.Reshape(op.Transpose(x, perm=[*axes, *rest]), _ints([-1, *sizes]))
    n = math.prod(shape[d] for d in axes)
    acc = op.Gather(rows, op.Constant(value_int=0), axis=0)
    for i in range(1, n):
        acc = _round_to(op.Mul(acc, op.Gather(rows, op.Constant(value_int=i), axis=0)), half)
    kept = [1 if d in axes else shape[d] for d in range(rank)] if keepdim else sizes
    return op.Reshape(acc, _ints(kept))


def _prod(x: Any, axes: list[int], keepdim: bool, dtype: Any) -> Any:
    out = _out_type(x, dtype)
    half, narrow = _half(x, out), _kind(x) in _HALF or out in _HALF.values()
    static, rank = _static(x), _rank(x)
    shape = [int(d) for d in x.shape] if static else []
    if out is not None:
        x = op.Cast(x, to=out)
    if rank == 0:
        return op.Identity(x)
    n = math.prod(shape[d] for d in axes) if static else 0
    if half is None or not 0 < n <= _CHAIN:
        return op.ReduceProd(x, _ints(axes), keepdims=int(keepdim))
    result = _chain_prod(op.Cast(x, to=_FLOAT), shape, axes, keepdim, half)
    return op.Cast(result, to=half) if narrow else result


def prod_all(x, dtype=None):
    return _prod(x, list(range(_rank(x))), False, dtype)


def prod_dim(x, dim: int, keepdim: bool = False, dtype=None):
    return _prod(x, [int(dim) % _rank(x)] if _rank(x) else [], keepdim, dtype)


# --------------------------------------------------------------------------- moments, norms


def var_mean(x, dim=None, correction=None, keepdim: bool = False):
    """(sum((x - mean)^2) / max(0, n - correction), mean); correction defaults to 1. torchlib's
    rule scales the biased variance by n / (n - correction), negative past n, and fails on 0-d.
    A 16-bit x is reduced in float32 with the correction unrounded, as torch's kernel (the
    constant folded to x's type would be rounded: a correction of 1.3 is 1.296875 in bfloat16)."""
    rank = _rank(x)
    c = 1.0 if correction is None else float(correction)
    if rank == 0:  # one element: (x - x)^2 / max(0, 1 - c), NaN for inf or NaN x, as torch
        d = op.Sub(x, x)
        return op.Div(op.Mul(d, d), _like(max(0.0, 1.0 - c), x)), op.Identity(x)
    wide = op.Cast(x, to=_FLOAT) if _kind(x) in _HALF else x
    axes = _axes(dim, rank)
    n = op.CastLike(op.ReduceProd(op.Gather(op.Shape(x), _ints(axes), axis=0), keepdims=0), wide)
    # sum / n, not ReduceMean: ONNX Runtime's mean of no elements is not torch's NaN (0 / 0)
    mean = op.Div(op.ReduceSum(wide, _ints(axes), keepdims=1), n)
    d = op.Sub(wide, mean)
    sq = op.ReduceSum(op.Mul(d, d), _ints(axes), keepdims=int(keepdim))
    divisor = op.Max(op.Sub(n, _like(c, wide)), _like(0.0, wide))
    mean = mean if keepdim else op.Squeeze(mean, _ints(axes))
    return op.CastLike(op.Div(sq, divisor), x), op.CastLike(mean, x)


def vector_norm(x, ord=2.0, dim=None, keepdim: bool = False, dtype=None):  # noqa: A002
    """sum(|x|^p)^(1/p); p = inf / -inf: max / min |x| (NaN propagates); p = 0: count of
    nonzeros. torchlib's rule drops keepdim for dim=None, skips NaN for inf, fails on 0-d."""
    rank = _rank(x)
    if dtype is not None and dtype != -1:
        x = op.Cast(x, to=int(dtype))
    p = float(ord)
    if rank == 0:  # |x| for every p but 0
        return op.CastLike(op.Not(op.Equal(x, _like(0.0, x))), x) if p == 0 else op.Abs(x)
    axes = _axes(dim, rank)
    a = op.Abs(x)

    def total(v):
        return op.ReduceSum(v, _ints(axes), keepdims=int(keepdim))

    if math.isinf(p):
        reduce = op.ReduceMax if p > 0 else op.ReduceMin
        return nan_propagating(reduce(a, _ints(axes), keepdims=int(keepdim)), x, axes, keepdim)
    if p == 0:
        return total(op.CastLike(op.Not(op.Equal(x, _like(0.0, x))), x))
    if p == 1:
        return total(a)
    if p == 2:
        return op.Sqrt(total(op.Mul(x, x)))
    # float32 exponents (Pow takes them): 1 / p in x's half type would round
    return op.Pow(total(op.Pow(a, op.Constant(value_float=p))), op.Constant(value_float=1.0 / p))


# --------------------------------------------------------------------------- sort, cumprod


def _stable_order(keys: Any, axis: int, descending: bool) -> INT64:
    # TopK with k = n sorts; ties keep the lower index first (ONNX's contract), so it is stable
    k = op.Shape(keys, start=axis, end=axis + 1)
    _, index = op.TopK(keys, k, axis=axis, largest=int(descending), sorted=1)
    return cast(INT64, index)


def _sort(x: Any, dim: int, descending: bool) -> tuple[Any, Any]:
    # floats: a stable sort by value with NaN as +inf, then a stable sort of that order by
    # "is NaN" puts every NaN after +inf (before it when descending), ties in index order
    rank = _rank(x)
    if rank == 0:
        return op.Identity(x), op.Constant(value_int=0)
    axis = int(dim) % rank
    if not _is_float(x):
        keys = op.Cast(x, to=_INT32) if _kind(x) == "BOOL" else x
        index = _stable_order(keys, axis, descending)
    else:
        nan = op.IsNaN(x)
        index = _stable_order(op.Where(nan, _like(math.inf, x), x), axis, descending)
        flags = op.GatherElements(op.Cast(nan, to=_INT32), index, axis=axis)
        index = op.GatherElements(index, _stable_order(flags, axis, descending), axis=axis)
    return op.GatherElements(x, index, axis=axis), index


def sort(x, dim: int = -1, descending: bool = False):
    return _sort(x, dim, descending)


def sort_stable(x, stable=None, dim: int = -1, descending: bool = False):
    return _sort(x, dim, descending)


def cumprod(x, dim: int, dtype=None):
    """Inclusive prefix product, accumulated as torch's CPU kernel does: one factor after
    another, in float32 for half types and float64 for float32, rounding only each output. Past
    _CHAIN factors, and for integers, by doubling (y *= y shifted by 1, 2, 4, ... along dim,
    padded with ones), floats in float64."""
    rank = _rank(x)
    out = _out_type(x, dtype)
    half = _half(x, out)
    result = out if out is not None else x.dtype.value  # ONNX type numbers
    n = x.shape[int(dim) % rank] if rank else 1
    if rank == 0:
        return op.Cast(x, to=result)
    axis = int(dim) % rank
    if not isinstance(n, int):
        raise ValueError(
            f"cumprod along a dynamic dim ({n}) is not exported; give dim {axis} a static size"
        )
    floating = result in _FLOAT_TYPES
    if floating and n <= _CHAIN:
        wide = op.Cast(x, to=_FLOAT if half else _DOUBLE)
        parts = [op.Slice(wide, _ints([0]), _ints([1]), _ints([axis]))]
        for i in range(1, n):
            parts.append(
                op.Mul(parts[-1], op.Slice(wide, _ints([i]), _ints([i + 1]), _ints([axis])))
            )
        return op.Cast(op.Concat(*parts, axis=axis), to=result)
    y = op.Cast(x, to=_DOUBLE if floating else result)
    shift = 1
    while shift < n:
        head = op.Slice(y, _ints([0]), _ints([n - shift]), _ints([axis]))
        y = op.Mul(y, op.Pad(head, _ints([shift, 0]), _like(1.0, y), _ints([axis])))
        shift *= 2
    return op.Cast(y, to=result)


# --------------------------------------------------------------------------- scatter_reduce

_INT_DTYPES = {"INT8": torch.int8, "UINT8": torch.uint8, "INT16": torch.int16}
_INT_DTYPES |= {"INT32": torch.int32, "INT64": torch.int64}
_SCATTER = {"sum": "add", "mean": "add", "prod": "mul", "amax": "max", "amin": "min"}


def _identity(reduce: str, x: Any, kind: str) -> Any:
    """The value a reduction starts from where include_self=False, typed like x (of `kind`)."""
    if reduce in ("sum", "mean"):
        return _like(0.0, x)
    if reduce == "prod":
        return _like(1.0, x)
    if kind in _FLOATS:
        return _like(-math.inf if reduce == "amax" else math.inf, x)
    info = torch.iinfo(_INT_DTYPES.get(kind, torch.int64))
    value = info.min if reduce == "amax" else info.max
    return op.CastLike(op.Constant(value_int=value), x)


def scatter_reduce(x, dim: int, index, src, reduce: str, include_self: bool = True):
    """x with src[:index.shape] reduced into x[index] along dim (ScatterElements' reductions);
    without include_self the targets start from the reduction's identity; mean divides the
    rounded sum by the count (floor division for integers); NaN propagates through amax/amin.
    Bool computes in int32 (sum and amax: or, prod and amin: and), half types in float32 (torch
    accumulates them in float32; ONNX Runtime has no float16 ScatterElements reductions)."""
    if reduce not in _SCATTER:
        raise ValueError(f"scatter_reduce has no reduction {str(reduce)[:40]!r}")
    kind, scalar = _kind(x), _rank(x) == 0
    if scalar:
        x, index, src = (op.Reshape(v, _ints([1])) for v in (x, index, src))
    rank = 1 if scalar else _rank(x)
    axis = int(dim) % rank
    compute = {"BOOL": "INT32", **dict.fromkeys(_HALF, "FLOAT")}.get(kind, kind)
    work = x if compute == kind else op.Cast(x, to=_TYPE[compute])
    updates = op.Slice(src, _ints([0] * rank), op.Shape(index), _ints(list(range(rank))))
    updates = updates if compute == kind else op.Cast(updates, to=_TYPE[compute])
    if not include_self:
        start = op.Expand(_identity(reduce, work, compute), op.Shape(index))
        work = op.ScatterElements(work, index, start, axis=axis)
    mode = _SCATTER[reduce]
    if kind == "BOOL":
        mode = {"add": "max", "mul": "min"}.get(mode, mode)
    result = op.ScatterElements(work, index, updates, axis=axis, reduction=mode)
    if reduce == "mean":
        result = _scatter_mean(result, work, kind, index, axis, include_self)
    if reduce in ("amax", "amin") and kind in _FLOATS:
        result = _scatter_nan(result, work, index, updates, axis, include_self)
    if compute != kind:
        result = op.Cast(result, to=_TYPE[kind])
    return op.Reshape(result, _ints([])) if scalar else result


def _scatter_mean(total: Any, x: Any, kind: str, index: Any, axis: int, include_self: bool):
    """total / count (x: the computed values, of a `kind` input)."""
    count = op.Expand(_like(1.0 if include_self else 0.0, x), op.Shape(x))
    ones = op.Expand(_like(1.0, x), op.Shape(index))
    count = op.Max(op.ScatterElements(count, index, ones, axis=axis, reduction="add"), _like(1, x))
    if kind in _FLOATS:  # torch rounds the sum to a half input's type before dividing
        return op.Div(_round_to(total, _HALF[kind]) if kind in _HALF else total, count)
    # floor division: (a - mod(a, b)) / b with mod taking b's sign (b > 0)
    return op.Div(op.Sub(total, op.Mod(total, count, fmod=0)), count)


def _scatter_nan(result: Any, x: Any, index: Any, updates: Any, axis: int, include_self: bool):
    """NaN where a NaN was reduced in (ONNX Runtime's max / min may drop it; torch keeps it)."""
    nan = op.CastLike(op.IsNaN(updates), x)
    zeros = op.Expand(_like(0.0, x), op.Shape(x))
    hits = op.ScatterElements(zeros, index, nan, axis=axis, reduction="add")
    poisoned = op.Greater(hits, _like(0.0, x))
    if include_self:  # x's own NaN (where nothing lands, result is x there anyway)
        poisoned = op.Or(poisoned, op.IsNaN(x))
    return op.Where(poisoned, _like(math.nan, x), result)


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _ATEN.argmin.default: argmin,
    _ATEN.argmax.default: argmax,
    _ATEN.min.dim: min_dim,
    _ATEN.max.dim: max_dim,
    _ATEN.max.default: max_all,
    _ATEN.min.default: min_all,
    _ATEN.any.default: any_all,
    _ATEN.any.dim: any_dim,
    _ATEN.any.dims: any_dims,
    _ATEN.prod.default: prod_all,
    _ATEN.prod.dim_int: prod_dim,
    _ATEN.var_mean.correction: var_mean,
    _ATEN.linalg_vector_norm.default: vector_norm,
    _ATEN.sort.default: sort,
    _ATEN.sort.stable: sort_stable,
    _ATEN.cumprod.default: cumprod,
    _ATEN.scatter_reduce.two: scatter_reduce,
}
