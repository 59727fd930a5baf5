"""Argument checks and the block layout shared by every MX implementation.

A tensor quantized along `axis` is read as `[outer, axis_len, inner]` (dims before the axis,
the axis, dims after it), and the axis as `n_blocks_axis` blocks of `block_size`. Block
`(o, j, i)` holds elements `(o, j * block_size + t, i)`; its scale byte sits at `(o, j, i)` of
the scales tensor (the input shape with the axis divided by `block_size`), so blocks numbered
`(o * n_blocks_axis + j) * inner + i` are the scales in memory order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from portable.errors import InputError

from .formats import SCALE_RULES, MXFormat, get_format

__all__ = ["BlockLayout", "check_dequantize", "check_quantize", "dequantize_layout"]

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_Q = "portable.mx_quantize.default"
_DQ = "portable.mx_dequantize.default"


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Where the blocks of a tensor quantized along `axis` lie (see the module docstring)."""

    shape: tuple[int, ...]  # the unquantized tensor's shape
    axis: int  # normalized: 0 <= axis < len(shape)
    block_size: int
    fmt: MXFormat

    @property
    def outer(self) -> int:
        return math.prod(self.shape[: self.axis])

    @property
    def axis_len(self) -> int:
        return self.shape[self.axis]

    @property
    def inner(self) -> int:
        return math.prod(self.shape[self.axis + 1 :])

    @property
    def blocks_per_axis(self) -> int:
        return self.axis_len // self.block_size

    @property
    def n_blocks(self) -> int:
        return self.outer * self.blocks_per_axis * self.inner

    def _with_axis(self, size: int) -> tuple[int, ...]:
        return (*self.shape[: self.axis], size, *self.shape[self.axis + 1 :])

    @property
    def codes_shape(self) -> tuple[int, ...]:
        packed = self.fmt.packed
        return self._with_axis(self.axis_len // 2 if packed else self.axis_len)

    @property
    def scales_shape(self) -> tuple[int, ...]:
        return self._with_axis(self.blocks_per_axis)


def _axis(op: str, shape: tuple[int, ...], axis: int) -> int:
    if not shape:
        raise InputError(
            "MX quantization needs a tensor with at least one dim, got a 0-dim tensor",
            op=op,
            fix="reshape the scalar to shape [n] first",
        )
    if not -len(shape) <= axis < len(shape):
        raise InputError(
            f"axis {axis} is out of range for shape {list(shape)}",
            op=op,
            fix=f"pick an axis in [{-len(shape)}, {len(shape) - 1}]",
        )
    return axis % len(shape)


def _block_size(op: str, fmt: MXFormat, block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InputError(
            f"block_size must be a positive int, got {block_size!r}", op=op, fix="use 32"
        )
    if fmt.packed and block_size % 2:
        raise InputError(
            f"{fmt.name} packs two codes per byte, so block_size must be even, got {block_size}",
            op=op,
            fix="use block_size=32",
        )


def _layout(op: str, shape: Sequence[int], fmt: MXFormat, axis: int, bs: int) -> BlockLayout:
    shape = tuple(int(s) for s in shape)
    _block_size(op, fmt, bs)
    lay = BlockLayout(shape, _axis(op, shape, axis), bs, fmt)
    if lay.axis_len % bs:
        up = -(-lay.axis_len // bs) * bs
        raise InputError(
            f"{fmt.name} blocks of {bs} along axis {axis} of shape {list(shape)}: "
            f"axis length {lay.axis_len} is not a multiple of {bs}",
            op=op,
            fix=f"pad dim {lay.axis} to a multiple of {bs} (e.g. {up}), "
            "or quantize along another axis",
        )
    return lay


def check_quantize(
    shape: Sequence[int], dtype: torch.dtype, format: str, axis: int, scale_rule: str,
    block_size: int,
) -> BlockLayout:  # fmt: skip
    """Validate `mx_quantize` arguments (InputError naming the values and the fix)."""
    fmt = get_format(format)
    if scale_rule not in SCALE_RULES:
        raise InputError(
            f"unknown MX scale rule {scale_rule!r}",
            op=_Q,
            fix=f"use one of: {', '.join(SCALE_RULES)}",
        )
    if dtype not in INPUT_DTYPES:
        raise InputError(
            f"MX quantization takes float32, bfloat16 or float16 input, got {dtype}",
            op=_Q,
            fix="cast the input to float32 first",
        )
    return _layout(_Q, shape, fmt, axis, block_size)


def dequantize_layout(
    codes_shape: Sequence[int], format: str, axis: int, dtype: torch.dtype, block_size: int
) -> BlockLayout:
    """Validate `mx_dequantize` arguments that shapes decide; the dequantized tensor's layout."""
    fmt = get_format(format)
    if dtype not in OUTPUT_DTYPES:
        raise InputError(
            f"MX dequantization produces a floating dtype, got {dtype}",
            op=_DQ,
            fix="use torch.float32, torch.bfloat16 or torch.float16",
        )
    shape = [int(s) for s in codes_shape]
    ax = _axis(_DQ, tuple(shape), axis)
    if fmt.packed:
        shape[ax] *= 2
    return _layout(_DQ, shape, fmt, axis, block_size)


def check_dequantize(
    codes: torch.Tensor, scales: torch.Tensor, format: str, axis: int, dtype: torch.dtype,
    block_size: int,
) -> BlockLayout:  # fmt: skip
    """Validate `mx_dequantize` arguments; returns the layout of the dequantized tensor."""
    for name, t in (("codes", codes), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise InputError(
                f"MX {name} must be uint8, got {t.dtype}",
                op=_DQ,
                fix="pass the tensors mx_quantize returned",
            )
    lay = dequantize_layout(codes.shape, format, axis, dtype, block_size)
    if tuple(scales.shape) != lay.scales_shape:
        raise InputError(
            f"scales of shape {list(scales.shape)} do not match codes of shape "
            f"{list(codes.shape)} ({lay.fmt.name}, axis {axis}, block_size {block_size}): "
            f"expected {list(lay.scales_shape)}",
            op=_DQ,
            fix="pass the codes and scales of one mx_quantize call with its format and axis",
        )
    return lay
