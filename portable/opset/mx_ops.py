"""Microscaling (MX) quantize / dequantize ops: schema and shape rules.

`mx_quantize(x, format, axis, scale_rule, block_size)` returns `(codes, scales)`: uint8 element
codes (FP4 packs two codes per byte along `axis`) and uint8 E8M0 scale bytes, one per block of
`block_size` elements along `axis`. `mx_dequantize` inverts it to `dtype`.

The bit-level semantics (shared/reference/mx.md) are defined once, in `portable.mx`, whose
`quantize` / `dequantize` are these ops' CPU kernels (contiguous outputs; InputError for an axis
length that is not a multiple of `block_size`). The fake kernels give shapes only.
"""

from __future__ import annotations

import torch

from portable import mx

from .library import define

FORMATS = tuple(mx.FORMATS)
SCALE_RULES = mx.SCALE_RULES

define(
    "mx_quantize(Tensor x, str format, int axis, str scale_rule='floor', int block_size=32) "
    "-> (Tensor, Tensor)"
)
define(
    "mx_dequantize(Tensor codes, Tensor scales, str format, int axis, ScalarType dtype, "
    "int block_size=32) -> Tensor"
)


def codes_shape(shape: list[int], fmt: str, axis: int) -> list[int]:
    out = list(shape)
    if fmt == "e2m1":
        out[axis] = (out[axis] + 1) // 2
    return out


def scales_shape(shape: list[int], axis: int, block_size: int) -> list[int]:
    out = list(shape)
    out[axis] = -(-out[axis] // block_size)
    return out


@torch.library.register_fake("portable::mx_quantize")
def _mx_quantize_fake(x, format, axis, scale_rule="floor", block_size=32):
    axis = axis % x.dim()
    codes = x.new_empty(codes_shape(list(x.shape), format, axis), dtype=torch.uint8)
    scales = x.new_empty(scales_shape(list(x.shape), axis, block_size), dtype=torch.uint8)
    return codes, scales


@torch.library.register_fake("portable::mx_dequantize")
def _mx_dequantize_fake(codes, scales, format, axis, dtype, block_size=32):
    axis = axis % codes.dim()
    shape = list(codes.shape)
    if format == "e2m1":
        shape[axis] *= 2
    return codes.new_empty(shape, dtype=dtype)


@torch.library.register_kernel("portable::mx_quantize", "cpu")
def _mx_quantize_cpu(x, format, axis, scale_rule="floor", block_size=32):
    return mx.quantize(x, format, axis, scale_rule, block_size)


@torch.library.register_kernel("portable::mx_dequantize", "cpu")
def _mx_dequantize_cpu(codes, scales, format, axis, dtype, block_size=32):
    return mx.dequantize(codes, scales, format, axis, dtype, block_size)
