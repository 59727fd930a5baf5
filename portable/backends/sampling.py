"""Where torch's CPU kernels read for interpolation and pooling, as static numpy arrays.

Pure numpy, no JAX or ONNX: the xla rules (backends/xla/rules/resample.py) and the onnx translations
(backends/onnx/translations/resize.py) gather with these indices and weigh with these weights,
so both backends read the pixels eager PyTorch reads. Shapes are static; every function is of
sizes and literal arguments only.

Interpolation (upsample_bilinear2d, upsample_nearest2d). torch's CPU kernels take one of two
paths by the output size: out_h + out_w <= 128 (or a channels-last input with more than 3
channels, which the lowerings do not see) runs its "channels-last" kernels, anything else its
generic N-d kernel. They pick source pixels and round weights differently; `vectorized_path`
says which one eager takes for a contiguous input.

Windows (pooling): per dim, `(position, valid)` arrays of shape [outputs, taps]: the input
position each tap of each output's window reads, and whether that tap is inside the window and
the input. `tap_grid` combines the dims into flat positions over the trailing spatial block.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = [
    "Axis",
    "adaptive_axis",
    "avg_divisor",
    "index_type",
    "linear_taps",
    "nearest_taps",
    "pool_axis",
    "round_to",
    "stored_weights",
    "tap_grid",
    "vectorized_path",
    "windows_holding",
]

Axis = tuple[np.ndarray, np.ndarray]  # (input position, valid), each [outputs, taps]

# --------------------------------------------------------------------------- rounding


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` rounded to `dtype` ("bfloat16", "float16", "float32" or "float64", to nearest
    even), returned as float32 (float64 for "float64")."""
    if dtype == "float64":
        return np.asarray(values, np.float64)
    v = np.asarray(values, np.float32)
    if dtype == "float16":
        return v.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":  # keep the high 16 bits, rounding half to even (finite values)
        bits = v.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)
    return v


def index_type(dtype: str) -> type:
    """The numpy type torch computes a `dtype` kernel's source positions in (its opmath)."""
    return np.float64 if dtype == "float64" else np.float32


# --------------------------------------------------------------------------- interpolation


def vectorized_path(out_hw: Sequence[int]) -> bool:
    """Whether eager resizes to `out_hw` with its channels-last ("vectorized") kernels."""
    return out_hw[0] + out_hw[1] <= 128


def _source_ratio(
    n_in: int, n_out: int, align_corners: bool, scale: float | None, acc: type
) -> Any:
    """torch's area_pixel_compute_scale: (in - 1) / (out - 1) with align_corners, else 1 / scale
    when a scale is given (> 0), else in / out; in `acc` arithmetic."""
    if align_corners:
        return acc(n_in - 1) / acc(n_out - 1) if n_out > 1 else acc(0)
    if scale is not None and scale > 0:
        return acc(1.0 / scale)
    return acc(n_in) / acc(n_out)


def _fused_multiply_add(a: Any, b: np.ndarray, c: float, acc: type) -> np.ndarray:
    """a * b + c rounded once to `acc`, per element of b: torch's CPU builds contract
    `ratio * (dst + 0.5) - 0.5` into one FMA (AVX2 / AVX-512 / NEON kernels); rounding the
    product apart moves src, and the weights, by an ulp of the index (1e-5 at index 80 in
    float32)."""
    exact = (Fraction(float(a)) * Fraction(float(v)) + Fraction(c) for v in np.ravel(b))
    return np.array([float(v) for v in exact]).astype(acc).reshape(np.shape(b))


def linear_taps(
    n_in: int, n_out: int, align_corners: bool, scale: float | None, acc: type
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(i0, i1, w0, w1) per output index of 1-d linear interpolation, as torch computes them:
    src = ratio * dst (align_corners) or max(ratio * (dst + 0.5) - 0.5, 0); i0 = floor(src)
    clamped to the input, i1 = i0 + 1 unless i0 is the last; w1 = src - i0 in [0, 1],
    w0 = 1 - w1. Equal sizes copy (w0 = 1, w1 = 0)."""
    dst = np.arange(n_out)
    if n_in == n_out:
        return dst, dst, np.ones(n_out, acc), np.zeros(n_out, acc)
    ratio = _source_ratio(n_in, n_out, align_corners, scale, acc)
    if align_corners:
        src = ratio * dst.astype(acc)
    else:
        src = np.maximum(_fused_multiply_add(ratio, dst + 0.5, -0.5, acc), acc(0))
    i0 = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
    w1 = np.minimum(np.maximum(src - i0.astype(acc), acc(0)), acc(1)).astype(acc)
    i1 = i0 + (i0 < n_in - 1)
    return i0, i1, (acc(1) - w1).astype(acc), w1


def stored_weights(w1: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(w0, w1) as torch's generic kernel keeps them: in the input's `dtype`, w1 rounded and
    w0 = 1 - w1 rounded (float32 arithmetic for the half types)."""
    w1 = round_to(w1, dtype)
    return round_to(w1.dtype.type(1) - w1, dtype), w1


def nearest_taps(
    n_in: int, n_out: int, scale: float | None, acc: type, vectorized: bool
) -> np.ndarray:
    """Source index per output index: floor(dst * ratio) clamped to the input, ratio as
    area_pixel_compute_scale without align_corners. The vectorized path (torch's nearest_idx)
    computes in float32 and copies equal sizes and halves twice the size outright; the
    generic path computes in `acc` and floors in float32 (floorf)."""
    dst = np.arange(n_out)
    if vectorized and n_out == n_in:
        return dst
    if vectorized and n_out == 2 * n_in:
        return dst // 2
    acc = np.float32 if vectorized else acc
    src = dst.astype(acc) * _source_ratio(n_in, n_out, False, scale, acc)
    return np.minimum(np.floor(src.astype(np.float32)).astype(np.int64), n_in - 1)


# --------------------------------------------------------------------------- windows


def pool_axis(n: int, out: int, k: int, s: int, p: int, d: int) -> Axis:
    """Window taps along one dim of a strided pool: position o * s - p + j * d for tap j,
    valid inside [0, n) (padding and ceil_mode's partial windows are invalid)."""
    pos = np.arange(out)[:, None] * s - p + np.arange(k)[None, :] * d
    return pos, (pos >= 0) & (pos < n)


def _adaptive_bounds(n: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Adaptive windows [floor(i * n / out), ceil((i + 1) * n / out)) along one dim."""
    i = np.arange(out)
    return i * n // out, -(-(i + 1) * n // out)


def adaptive_axis(n: int, out: int) -> Axis:
    """Window taps along one dim of an adaptive pool, padded to the longest window."""
    start, end = _adaptive_bounds(n, out)
    taps = np.arange(int((end - start).max()))[None, :]
    return start[:, None] + taps, taps < (end - start)[:, None]


def windows_holding(n: int, out: int) -> Axis:
    """The transpose of `adaptive_axis`: for each of n input positions, the adaptive windows
    (of `out`) that hold it, in increasing order, padded to the most."""
    start, end = _adaptive_bounds(n, out)
    inside = (start[None, :] <= np.arange(n)[:, None]) & (np.arange(n)[:, None] < end[None, :])
    first, count = inside.argmax(axis=1), inside.sum(axis=1)
    taps = np.arange(int(count.max()))[None, :]
    return first[:, None] + taps, taps < count[:, None]


def tap_grid(sizes: Sequence[int], axes: Sequence[Axis]) -> tuple[np.ndarray, np.ndarray]:
    """(flat position in the spatial block of `sizes`, valid) of every tap, as
    [O1, ..., On, taps] with the taps of each window in row-major order (the order torch's
    kernels visit them). Invalid taps point at a valid position (clipped), to be masked."""
    n = len(axes)
    flat, valid = np.zeros((1,) * 2 * n, np.int64), np.ones((1,) * 2 * n, bool)
    for i, (pos, ok) in enumerate(axes):
        shape = [1] * 2 * n
        shape[i], shape[n + i] = pos.shape
        stride = math.prod(sizes[i + 1 :])
        flat = flat + np.clip(pos, 0, sizes[i] - 1).reshape(shape) * stride
        valid = valid & ok.reshape(shape)
    outs = tuple(pos.shape[0] for pos, _ in axes)
    full = outs + tuple(pos.shape[1] for pos, _ in axes)
    flat = np.broadcast_to(flat, full).reshape(outs + (-1,))
    return flat, np.broadcast_to(valid, full).reshape(outs + (-1,))


def avg_divisor(
    sizes: Sequence[int], windows: Iterable[tuple[int, int, int, int]], count_include_pad: bool
) -> np.ndarray:
    """torch's per-window divisor over N dims, windows given per dim as (out, k, s, p): the
    product over dims of the window clipped to the padded input (count_include_pad) or to
    the input itself; 1 for a window wholly outside the input (its sum is 0, as torch leaves
    such outputs)."""
    divisor = np.ones(())
    for n, (o, k, s, p) in zip(sizes, windows, strict=True):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, n + p)
        size = end - start
        if not count_include_pad:
            size = np.minimum(end, n) - np.maximum(start, 0)
        divisor = np.multiply.outer(divisor, size)
    return np.where(divisor > 0, divisor, 1)
