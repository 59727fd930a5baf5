"""Interpolation (bilinear, nearest) and the N-d window pools beyond 2-d max / avg (adaptive max,
3-d max and average, adaptive 3-d average) with their backward ops.

Each reads the pixels torch's CPU kernels read, in their order and with their weights
(backends/sampling.py computes those from the sizes alone): nearest and the max pools exactly,
bilinear and the averages to torch's rounding. The max pools return int64 indices into each
input plane, flattened, choosing the tap torch chooses (the last NaN, else the first maximum).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from portable.backends import sampling

from . import RULES
from ._util import PRECISION, opmath, out_dtype, out_shape, pair
from .nn import adaptive_matrix, pool_mean

# --------------------------------------------------------------------------- interpolation
# Source pixels and weights are torch's, from backends/sampling.py (which of its two kernel
# paths eager takes, the FMA in the source position, weights stored in the input dtype).


def _scales(scale_factors):
    return (None, None) if scale_factors is None else tuple(scale_factors)


def _bilinear(x, out_hw, align_corners, scales):
    dtype = jnp.dtype(x.dtype).name
    compute, acc = opmath(x.dtype), sampling.index_type(dtype)
    (h, w), (oh, ow) = x.shape[-2:], out_hw
    h0, h1, a0, a1 = sampling.linear_taps(h, oh, align_corners, scales[0], acc)
    w0, w1, b0, b1 = sampling.linear_taps(w, ow, align_corners, scales[1], acc)
    xf = x.astype(compute)
    x0, x1 = jnp.take(xf, h0, axis=-2), jnp.take(xf, h1, axis=-2)

    def corner(rows, cols):
        return jnp.take(rows, cols, axis=-1)

    if sampling.vectorized_path(out_hw):
        # x00 * w00 + (x01 * w01 + (x11 * w11 + x10 * w10)), wij = hi_lambda * wj_lambda: the
        # order of torch's vectorized channel loop (how XLA contracts it into FMAs may differ
        # from the C++ compiler by an ulp)
        a0, a1, b0, b1 = a0[:, None], a1[:, None], b0[None, :], b1[None, :]
        wt = [jnp.asarray(v, compute) for v in (a0 * b0, a0 * b1, a1 * b0, a1 * b1)]
        y = corner(x0, w0) * wt[0] + (
            corner(x0, w1) * wt[1] + (corner(x1, w1) * wt[3] + corner(x1, w0) * wt[2])
        )
    else:
        # along W, then those rows along H: a0 * (b0 * x00 + b1 * x01) + a1 * (...)
        rows, cols = sampling.stored_weights(a1, dtype), sampling.stored_weights(b1, dtype)
        c0, c1 = (jnp.asarray(v, compute) for v in cols)
        r0, r1 = (jnp.asarray(v[:, None], compute) for v in rows)
        y = (corner(x0, w0) * c0 + corner(x0, w1) * c1) * r0
        y = y + (corner(x1, w0) * c0 + corner(x1, w1) * c1) * r1
    return y.astype(x.dtype)


@RULES.register("aten.upsample_bilinear2d.vec")
def upsample_bilinear2d(ctx, x, output_size, align_corners, scale_factors):
    # the recorded output shape is output_size, or floor(in * scale) per dim
    return _bilinear(x, out_shape(ctx)[-2:], align_corners, _scales(scale_factors))


def _nearest(x, out_hw, scales):
    acc = sampling.index_type(jnp.dtype(x.dtype).name)
    vectorized = sampling.vectorized_path(out_hw)
    rows = sampling.nearest_taps(x.shape[-2], out_hw[0], scales[0], acc, vectorized)
    cols = sampling.nearest_taps(x.shape[-1], out_hw[1], scales[1], acc, vectorized)
    return jnp.take(jnp.take(x, rows, axis=-2), cols, axis=-1)


@RULES.register("aten.upsample_nearest2d.vec")
def upsample_nearest2d_vec(ctx, x, output_size, scale_factors):
    return _nearest(x, out_shape(ctx)[-2:], _scales(scale_factors))


@RULES.register("aten.upsample_nearest2d.default")
def upsample_nearest2d(ctx, x, output_size, scales_h=None, scales_w=None):
    return _nearest(x, out_shape(ctx)[-2:], (scales_h, scales_w))


# --------------------------------------------------------------------------- N-d windows


def _taps(x, axes, fill):
    """Every window tap over the trailing len(axes) dims of x, as [..., O1, ..., On, taps] in
    torch's visiting order, with (static) each tap's flat position in the spatial block and
    whether it is inside its window; taps outside are `fill`."""
    n = len(axes)
    sizes = x.shape[x.ndim - n :]
    flat, valid = sampling.tap_grid(sizes, axes)
    lead = x.shape[: x.ndim - n]
    index = flat.reshape(-1).astype(np.int32 if math.prod(sizes) < 2**31 else np.int64)
    planes = x.reshape(lead + (math.prod(sizes),))  # not -1: ambiguous for an empty batch
    taps = jnp.take(planes, index, axis=-1).reshape(lead + flat.shape)
    return jnp.where(valid, taps, jnp.asarray(fill, x.dtype)), flat, valid


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_of_taps(ctx, x, axes):
    """(max, int64 flat input index) per window, as torch's CPU kernels choose it: scanning the
    window in order, a tap wins if it is greater than the best so far or NaN; so the last NaN,
    else the first tap holding the max (the first tap when all are -inf)."""
    taps, flat, valid = _taps(x, axes, _lowest(x.dtype))
    values = jnp.max(taps, axis=-1)
    tap = jnp.argmax((taps == values[..., None]) & valid, axis=-1)
    if jnp.issubdtype(x.dtype, jnp.floating):
        # XLA:CPU's max reduction may drop NaN: propagate it explicitly
        nan = jnp.isnan(taps)
        has_nan = jnp.any(nan, axis=-1)
        last_nan = taps.shape[-1] - 1 - jnp.argmax(nan[..., ::-1], axis=-1)
        tap = jnp.where(has_nan, last_nan, tap)
        values = jnp.where(has_nan, jnp.asarray(jnp.nan, x.dtype), values)
    where = jnp.broadcast_to(jnp.asarray(flat, out_dtype(ctx, 1)), taps.shape)
    return values, jnp.take_along_axis(where, tap[..., None], axis=-1)[..., 0]


def _grad_to_indices(ctx, grad, x, indices, n):
    """Each output's grad added to the input element its flat index (over the trailing n dims)
    names, in output order and in the grad's dtype, as torch's kernel adds them (so half types
    round after every add where windows overlap)."""
    planes = math.prod(x.shape[: x.ndim - n])
    dtype = out_dtype(ctx)
    outputs = math.prod(grad.shape[grad.ndim - n :])  # not -1: ambiguous for an empty batch
    g = grad.reshape(planes, outputs).astype(dtype)
    idx = indices.reshape(planes, outputs)
    plane = jax.lax.broadcasted_iota(idx.dtype, idx.shape, 0)
    out = jnp.zeros((planes, math.prod(x.shape[x.ndim - n :])), dtype)
    return out.at[plane, idx].add(g).reshape(x.shape)


def _window_args(n, kernel_size, stride, padding, dilation=1):
    k = pair(kernel_size, n)
    s = pair(stride, n) if stride else k  # an empty stride means the kernel size
    return k, s, pair(padding, n), pair(dilation, n)


def _pool_axes(x, out_sizes, kernel_size, stride, padding, dilation=1):
    n = len(out_sizes)
    k, s, p, d = _window_args(n, kernel_size, stride, padding, dilation)
    sizes = x.shape[x.ndim - n :]
    return [sampling.pool_axis(*a) for a in zip(sizes, out_sizes, k, s, p, d, strict=True)]


def _ordered_sum(taps):
    """Sum over the last axis tap by tap in window order, as torch's pooling kernels add (up to
    64 taps; larger windows reduce in XLA's order)."""
    if taps.shape[-1] > 64:
        return jnp.sum(taps, axis=-1)
    total = taps[..., 0]
    for k in range(1, taps.shape[-1]):
        total = total + taps[..., k]
    return total


def _scan_sum(taps, dtype):
    """Sum over the last axis in order, rounding to dtype after every add (torch's half-type
    accumulation in its adaptive average pools)."""

    def add(total, tap):
        return total + tap, None

    zero = jnp.zeros(taps.shape[:-1], dtype)
    return jax.lax.scan(add, zero, jnp.moveaxis(taps.astype(dtype), -1, 0))[0]


# --------------------------------------------------------------------------- adaptive max, 3-d pools


def _adaptive_max_pool(rank: int) -> None:
    """adaptive_max_pool{rank}d and its backward (2-d: core opset; 3-d: the spatial family)."""

    @RULES.register(f"aten.adaptive_max_pool{rank}d.default")
    def forward(ctx, x, output_size):
        sizes = zip(x.shape[-rank:], out_shape(ctx)[-rank:], strict=True)
        return _max_of_taps(ctx, x, [sampling.adaptive_axis(n, o) for n, o in sizes])

    @RULES.register(f"aten.adaptive_max_pool{rank}d_backward.default")
    def backward(ctx, grad, x, indices):
        return _grad_to_indices(ctx, grad, x, indices, rank)


_adaptive_max_pool(2)
_adaptive_max_pool(3)


@RULES.register("aten.max_pool3d_with_indices.default")
def max_pool3d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    # ceil_mode is already in the recorded output size; taps past the input are skipped
    axes = _pool_axes(x, out_shape(ctx)[-3:], kernel_size, stride, padding, dilation)
    return _max_of_taps(ctx, x, axes)


@RULES.register("aten.max_pool3d_with_indices_backward.default")
def max_pool3d_with_indices_backward(
    ctx, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    return _grad_to_indices(ctx, grad, x, indices, 3)


def _avg_pool_nd(x, out_sizes, kernel_size, stride, padding, count_include_pad, divisor):
    # the window's sum in window order, in opmath, over torch's divisor (sampling.avg_divisor)
    n = len(out_sizes)
    k, s, p, _ = _window_args(n, kernel_size, stride, padding)
    compute = opmath(x.dtype)
    taps, _, _ = _taps(x.astype(compute), _pool_axes(x, out_sizes, k, s, p), 0)
    total = _ordered_sum(taps)
    if divisor is None:
        windows = zip(out_sizes, k, s, p, strict=True)
        divisor = sampling.avg_divisor(x.shape[x.ndim - n :], windows, count_include_pad)
    return pool_mean(total, divisor, compute).astype(x.dtype)


@RULES.register("aten.avg_pool3d.default")
def avg_pool3d(
    ctx,
    x,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    out = out_shape(ctx)[-3:]
    return _avg_pool_nd(x, out, kernel_size, stride, padding, count_include_pad, divisor_override)


@RULES.register("aten.avg_pool3d_backward.default")
def avg_pool3d_backward(
    ctx, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    def forward(inp):
        args = (kernel_size, stride, padding, count_include_pad, divisor_override)
        return _avg_pool_nd(inp, grad.shape[-3:], *args)

    _, vjp = jax.vjp(forward, x)
    return vjp(grad.astype(x.dtype))[0]


def _divide_by_counts(total, counts, dtype):
    """total / kd / kh / kw, each division in `dtype` as torch's kernel does it (half types:
    the count rounded to dtype, the quotient rounded after each division)."""
    compute = opmath(dtype)
    shapes = ((-1, 1, 1), (1, -1, 1), (1, 1, -1))
    for k, shape in zip(counts, shapes, strict=True):
        divisor = jnp.asarray(k.reshape(shape), dtype).astype(compute)
        total = (total.astype(compute) / divisor).astype(total.dtype)
    return total


def _adaptive_axes(x, output_size):
    sizes = zip(x.shape[-3:], pair(output_size, 3), strict=True)
    return [sampling.adaptive_axis(n, o) for n, o in sizes]


@RULES.register("aten._adaptive_avg_pool3d.default")
def adaptive_avg_pool3d(ctx, x, output_size):
    # torch's CPU kernel sums each window in (d, h, w) order in the input dtype itself, also
    # for bfloat16 / float16 (rounding after every add), then divides by kd, kh and kw
    axes = _adaptive_axes(x, output_size)
    taps, _, _ = _taps(x, axes, 0)  # taps past a window are 0: adding them is exact
    half = opmath(x.dtype) != x.dtype
    total = _scan_sum(taps, x.dtype) if half else _ordered_sum(taps)
    return _divide_by_counts(total, [ok.sum(1) for _, ok in axes], x.dtype)


@RULES.register("aten._adaptive_avg_pool3d_backward.default")
def adaptive_avg_pool3d_backward(ctx, grad, x):
    # torch: delta = grad / kd / kh / kw in the grad's dtype, added to every input of its
    # window in window order (in the dtype itself for half types)
    axes = _adaptive_axes(x, grad.shape[-3:])
    delta = _divide_by_counts(grad.astype(x.dtype), [ok.sum(1) for _, ok in axes], x.dtype)
    if opmath(x.dtype) != x.dtype:
        sizes = zip(x.shape[-3:], grad.shape[-3:], strict=True)
        taps, _, _ = _taps(delta, [sampling.windows_holding(n, o) for n, o in sizes], 0)
        return _scan_sum(taps, x.dtype).astype(out_dtype(ctx))
    compute = opmath(x.dtype)
    ms = [adaptive_matrix(n, o) for n, o in zip(x.shape[-3:], grad.shape[-3:], strict=True)]
    out = jnp.einsum(
        "...pqr,pd,qh,rw->...dhw",
        delta.astype(compute),
        *(jnp.asarray(m, compute) for m in ms),
        precision=PRECISION,
    )
    return out.astype(out_dtype(ctx))
