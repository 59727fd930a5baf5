"""ONNX rules for the ATen ops of interpolation, adaptive max and 3-d pooling, `diagonal_scatter`
and `repeat` (opset 1.3) whose torch.onnx rules are missing or wrong; group norm and `diagonal`
are translated by torch.onnx's own library.

What torchlib gets wrong, and each rule here fixes:
- `upsample_bilinear2d.vec`, `upsample_nearest2d`: torchlib's `Resize` places source pixels its
  own way. With a scale given it resamples a dim the scale leaves at its size (torch copies it:
  scale_factor (1.1, 1.3) on 5 x 7 is wrong by 1.3), its output size is floor(in * float32
  scale), which can be one less than torch's, and nearest differs where torch copies or halves
  outright. The rules gather the pixels torch's CPU kernels read, with their weights
  (backends/sampling.py, shared with the xla rules).
- `adaptive_max_pool2d`, `_adaptive_avg_pool3d`: torchlib has no rule that exports.
- `max_pool3d_with_indices`: ONNX Runtime's MaxPool has no int64 kernel; the rule also takes the
  index torch takes (the last NaN, else the first maximum).
- `avg_pool3d`: `AveragePool` always divides by the window size, ignoring divisor_override.
- `diagonal_scatter`: torch.onnx decomposes it through an in-place copy, which fails to export.
- `repeat` by all ones: torchlib returns the input value itself, which the bfloat16 rewrite
  cannot give an output name of its own (an `Identity` node here).

The window rules gather every tap of every window (`sampling.tap_grid`) and reduce over the taps.
Inputs must have static spatial sizes. The bfloat16 rewrite of export (bfloat16.py) computes each
rule in float32 and rounds its results; an explicit `Cast` to the input's type inside a rule
rounds there (the adaptive average pool of a half type adds and divides in it, as torch does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from onnxscript import ir, opset23
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

from portable.backends import sampling

__all__ = ["TRANSLATIONS"]

# onnxscript types an op's result as the union of its schema's types, which the next op's stub
# refuses; these rules check their inputs' types themselves (`_kind`)
op: Any = opset23

_ATEN = torch.ops.aten

# ONNX type numbers (onnx.TensorProto)
_FLOAT, _DOUBLE, _INT32, _INT64, _BOOL = 1, 11, 6, 7, 9
_NAMES = {"FLOAT": "float32", "DOUBLE": "float64", "BFLOAT16": "bfloat16", "FLOAT16": "float16"}
_HALF = {"BFLOAT16", "FLOAT16"}
# a half-type window sum is a chain of this many rounded adds at most; larger windows sum once
_CHAIN = 256


def _kind(x: Any) -> str:
    if x.dtype is None:
        raise ValueError("a value without a known dtype reached a resize rule")
    return x.dtype.name


def _sizes(x: Any, n: int) -> tuple[int, ...]:
    """The static sizes of x's last n dims."""
    dims = tuple(x.shape)[-n:]
    if not all(isinstance(d, int) for d in dims):
        raise ValueError(f"resize rules need static spatial sizes, got {dims}")
    return tuple(int(d) for d in dims)


def _const(array: np.ndarray) -> Any:
    return op.Constant(value=ir.tensor(np.ascontiguousarray(array)))


def _ints(values: Sequence[int]) -> Any:
    return op.Constant(value_ints=[int(v) for v in values])


def _compute_type(x: Any) -> int:
    """The ONNX type a rule computes x's values in: float64 for float64, else float32."""
    return _DOUBLE if _kind(x) == "DOUBLE" else _FLOAT


def _weights(values: np.ndarray, compute: int) -> Any:
    return _const(np.asarray(values, np.float64 if compute == _DOUBLE else np.float32))


# --------------------------------------------------------------------------- interpolation


def _out_size(x: Any, output_size, scales) -> tuple[int, int]:
    if output_size is not None:
        return int(output_size[0]), int(output_size[1])
    h, w = _sizes(x, 2)
    return int(h * scales[0]), int(w * scales[1])  # torch: floor(in * scale) in double


def _bilinear(x, out_hw, align_corners: bool, scales):
    # the xla rule's arithmetic (rules/resample.py `_bilinear`): four corners weighed as torch's
    # vectorized kernel weighs them, or rows then columns with weights stored in x's dtype
    dtype = _NAMES[_kind(x)]
    acc, compute = sampling.index_type(dtype), _compute_type(x)
    (h, w), (oh, ow) = _sizes(x, 2), out_hw
    h0, h1, a0, a1 = sampling.linear_taps(h, oh, align_corners, scales[0], acc)
    w0, w1, b0, b1 = sampling.linear_taps(w, ow, align_corners, scales[1], acc)
    xf = op.Cast(x, to=compute)
    x0, x1 = op.Gather(xf, _const(h0), axis=-2), op.Gather(xf, _const(h1), axis=-2)

    def corner(rows, cols):
        return op.Gather(rows, _const(cols), axis=-1)

    if sampling.vectorized_path(out_hw):
        a0, a1, b0, b1 = a0[:, None], a1[:, None], b0[None, :], b1[None, :]
        wt = [_weights(v, compute) for v in (a0 * b0, a0 * b1, a1 * b0, a1 * b1)]
        inner = op.Add(op.Mul(corner(x1, w1), wt[3]), op.Mul(corner(x1, w0), wt[2]))
        y = op.Add(op.Mul(corner(x0, w0), wt[0]), op.Add(op.Mul(corner(x0, w1), wt[1]), inner))
    else:
        a0, a1 = sampling.stored_weights(a1, dtype)
        b0, b1 = sampling.stored_weights(b1, dtype)
        bw0, bw1 = _weights(b0, compute), _weights(b1, compute)
        aw0, aw1 = _weights(a0[:, None], compute), _weights(a1[:, None], compute)
        top = op.Add(op.Mul(corner(x0, w0), bw0), op.Mul(corner(x0, w1), bw1))
        bottom = op.Add(op.Mul(corner(x1, w0), bw0), op.Mul(corner(x1, w1), bw1))
        y = op.Add(op.Mul(top, aw0), op.Mul(bottom, aw1))
    return op.Cast(y, to=int(x.dtype))


def upsample_bilinear2d_vec(self, output_size, align_corners: bool, scale_factors):
    scales = (None, None) if scale_factors is None else tuple(scale_factors)
    out_hw = _out_size(self, output_size, scales)
    return _bilinear(self, out_hw, bool(align_corners), scales)


def _nearest(x, out_hw, scales):
    acc = sampling.index_type(_NAMES.get(_kind(x), "float32"))
    vectorized = sampling.vectorized_path(out_hw)
    (h, w), (oh, ow) = _sizes(x, 2), out_hw
    rows = sampling.nearest_taps(h, oh, scales[0], acc, vectorized)
    cols = sampling.nearest_taps(w, ow, scales[1], acc, vectorized)
    return op.Gather(op.Gather(x, _const(rows), axis=-2), _const(cols), axis=-1)


def upsample_nearest2d_vec(self, output_size, scale_factors):
    scales = (None, None) if scale_factors is None else tuple(scale_factors)
    return _nearest(self, _out_size(self, output_size, scales), scales)


def upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return _nearest(self, (int(output_size[0]), int(output_size[1])), (scales_h, scales_w))


# --------------------------------------------------------------------------- windows


def _taps(x, axes: Sequence[sampling.Axis], fill: float | int):
    """(taps, flat, valid): every window tap over x's trailing len(axes) dims as
    [..., O1, ..., On, taps] (taps outside their window are `fill`), with the static flat
    position and validity of each."""
    n = len(axes)
    rank = len(x.shape)
    flat, valid = sampling.tap_grid(_sizes(x, n), axes)
    planes = op.Reshape(x, _ints([0] * (rank - n) + [math.prod(_sizes(x, n))]))
    taps = op.Gather(planes, _const(flat), axis=rank - n)
    fill_value = op.CastLike(_const(np.array(fill)), x)
    return op.Where(_const(valid), taps, fill_value), flat, valid


def _max_of_taps(x, axes: Sequence[sampling.Axis]):
    """(max, int64 flat index) per window, choosing the tap torch's CPU kernels choose: the
    last NaN, else the first tap holding the max (the first tap when all are -inf)."""
    floating = _kind(x) in _NAMES
    taps, flat, valid = _taps(x, axes, -math.inf if floating else _int_lowest(x))
    best = op.ReduceMax(taps, _ints([-1]), keepdims=1)
    holds = op.And(op.Equal(taps, best), _const(valid))
    first = op.ArgMax(op.Cast(holds, to=_INT32), axis=-1, keepdims=1)
    tap, values = first, op.Squeeze(best, _ints([-1]))
    if floating:
        # ONNX Runtime's ReduceMax may skip NaN: torch's window max is NaN if any tap is
        nan = op.Cast(op.IsNaN(taps), to=_INT32)
        has_nan = op.Cast(op.ReduceMax(nan, _ints([-1]), keepdims=1), to=_BOOL)
        last_nan = op.ArgMax(nan, axis=-1, keepdims=1, select_last_index=1)
        tap = op.Where(has_nan, last_nan, first)
        nan_value = op.CastLike(_const(np.array(math.nan, np.float32)), x)
        values = op.Where(op.Squeeze(has_nan, _ints([-1])), nan_value, values)
    where = op.Expand(_const(flat), op.Shape(taps))
    index = op.Squeeze(op.GatherElements(where, tap, axis=-1), _ints([-1]))
    return values, index


_INT_BITS = {"INT64": 64, "INT32": 32, "INT16": 16, "INT8": 8}


def _int_lowest(x) -> int:
    """The least value of x's integer type (0 for the unsigned ones)."""
    bits = _INT_BITS.get(_kind(x))
    return -(2 ** (bits - 1)) if bits else 0


def adaptive_max_pool2d(self, output_size):
    sizes = zip(_sizes(self, 2), output_size, strict=True)
    return _max_of_taps(self, [sampling.adaptive_axis(n, int(o)) for n, o in sizes])


def _pool_out(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape: the last window must start inside the input or its left
    padding."""
    out = (n + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    return out - 1 if ceil_mode and (out - 1) * s >= n + p else out


def _window_args(kernel_size, stride, padding, dilation=1):
    def three(v):
        v = [v] if isinstance(v, int) else list(v)
        return [int(i) for i in (v * 3 if len(v) == 1 else v)]

    k = three(kernel_size)
    return k, three(stride) if stride else k, three(padding), three(dilation)


def _pool_axes(x, kernel_size, stride, padding, dilation, ceil_mode):
    k, s, p, d = _window_args(kernel_size, stride, padding, dilation)
    sizes = _sizes(x, 3)
    outs = [_pool_out(*a, ceil_mode) for a in zip(sizes, k, s, p, d, strict=True)]
    axes = [sampling.pool_axis(*a) for a in zip(sizes, outs, k, s, p, d, strict=True)]
    return axes, outs, (k, s, p)


def max_pool3d_with_indices(
    self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode: bool = False
):
    axes, _, _ = _pool_axes(self, kernel_size, stride, padding, dilation, bool(ceil_mode))
    return _max_of_taps(self, axes)


def avg_pool3d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override=None,
):
    if divisor_override is None:
        k, s, p, _ = _window_args(kernel_size, stride, padding)
        return torchlib_nn.aten_avg_pool3d(self, k, s, p, bool(ceil_mode), count_include_pad)
    # the window's sum over divisor_override (taps on padding and past the input add 0)
    axes, _, _ = _pool_axes(self, kernel_size, stride, padding, 1, bool(ceil_mode))
    compute = _compute_type(self)
    taps = op.Cast(_taps(self, axes, 0)[0], to=compute)
    total = op.ReduceSum(taps, _ints([-1]), keepdims=0)
    divisor = op.CastLike(_const(np.array(float(divisor_override))), total)
    return op.Cast(op.Div(total, divisor), to=int(self.dtype))


def _adaptive_axes(x, output_size) -> list[sampling.Axis]:
    sizes = zip(_sizes(x, 3), output_size, strict=True)
    return [sampling.adaptive_axis(n, int(o)) for n, o in sizes]


def _round(value, x):
    """value rounded to x's type where torch computes in it (half types), kept in float32."""
    return op.Cast(op.Cast(value, to=int(x.dtype)), to=_FLOAT) if _kind(x) in _HALF else value


def adaptive_avg_pool3d(self, output_size):
    # the xla rule's arithmetic (rules/resample.py `adaptive_avg_pool3d`): each window summed in
    # (d, h, w) order, in the input's type for half types, then / kd / kh / kw
    axes = _adaptive_axes(self, output_size)
    compute = _compute_type(self)
    taps = op.Cast(_taps(self, axes, 0)[0], to=compute)
    count = axes[0][0].shape[1] * axes[1][0].shape[1] * axes[2][0].shape[1]
    if _kind(self) in _HALF and count <= _CHAIN:
        tap = [op.Squeeze(t, _ints([-1])) for t in op.Split(taps, axis=-1, num_outputs=count)]
        total = tap[0]
        for k in range(1, count):
            total = _round(op.Add(total, tap[k]), self)
    else:
        total = _round(op.ReduceSum(taps, _ints([-1]), keepdims=0), self)
    shapes = ((-1, 1, 1), (1, -1, 1), (1, 1, -1))
    dtype = _NAMES[_kind(self)]
    for (_, valid), shape in zip(axes, shapes, strict=True):
        divisor = sampling.round_to(valid.sum(1).astype(np.float64), dtype).reshape(shape)
        total = _round(op.Div(total, _weights(divisor, compute)), self)
    return op.Cast(total, to=int(self.dtype))


# --------------------------------------------------------------------------- layout


def repeat(self, repeats):
    """torchlib's rule, except that tiling by all ones is an Identity node: torchlib returns the
    input value itself, and a graph whose output is its input breaks the bfloat16 rewrite."""
    if len(repeats) == len(self.shape) and all(isinstance(r, int) and r == 1 for r in repeats):
        return op.Identity(self)
    return torchlib_core.aten_repeat(self, repeats)


def diagonal_scatter(self, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    """x with its diagonal at `offset` of the (dim1, dim2) planes replaced by src: the planes
    moved last and flattened, src scattered at the diagonal's flat positions, moved back.
    (torch.onnx decomposes this op through an in-place copy, which fails to export.)"""
    shape = _sizes(self, len(self.shape))
    rank = len(shape)
    d1, d2 = dim1 % rank, dim2 % rank
    rest = [d for d in range(rank) if d not in (d1, d2)]
    perm = [*rest, d1, d2]
    rows, cols = shape[d1], shape[d2]
    length = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    i = np.arange(length)
    flat = (i + max(-offset, 0)) * cols + i + max(offset, 0)
    planes = math.prod(shape[d] for d in rest)
    x = op.Reshape(op.Transpose(self, perm=perm), _ints([planes, rows * cols]))
    index = _const(np.broadcast_to(flat, (planes, length)).astype(np.int64))
    values = op.Reshape(op.CastLike(src, self), _ints([planes, length]))
    x = op.ScatterElements(x, index, values, axis=1)
    x = op.Reshape(x, _ints([*(shape[d] for d in rest), rows, cols]))
    return op.Transpose(x, perm=[int(j) for j in np.argsort(perm)])


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _ATEN.upsample_bilinear2d.vec: upsample_bilinear2d_vec,
    _ATEN.upsample_nearest2d.vec: upsample_nearest2d_vec,
    _ATEN.upsample_nearest2d.default: upsample_nearest2d,
    _ATEN.adaptive_max_pool2d.default: adaptive_max_pool2d,
    _ATEN.max_pool3d_with_indices.default: max_pool3d_with_indices,
    _ATEN.avg_pool3d.default: avg_pool3d,
    _ATEN._adaptive_avg_pool3d.default: adaptive_avg_pool3d,
    _ATEN.diagonal_scatter.default: diagonal_scatter,
    _ATEN.repeat.default: repeat,
}
