"""Microscaling (MX) quantize / dequantize ops: schema and shape rules.

`mx_quantize(x, format, axis, scale_rule, block_size)` returns `(codes, scales)`: uint8 element
codes (FP4 packs two codes per byte along `axis`) and uint8 E8M0 scale bytes, one per block of
`block_size` elements along `axis`. `mx_dequantize` inverts it to `dtype`. The bit-level
semantics (see shared/reference/mx.md) and their CPU kernels belong to the `mx-quantize` pass;
until then these ops have schemas and shape rules only, and the `cpu` backend reports them as
unsupported.
"""

from __future__ import annotations

import torch

from .library import define

FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8")
SCALE_RULES = ("floor", "rceil", "ceil", "even")

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
