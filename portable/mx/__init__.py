"""Microscaling (MX) quantization: the one definition of its semantics (shared/reference/mx.md).

`quantize(x, format, axis, scale_rule, block_size) -> (codes, scales)` and `dequantize(...)` are
the CPU kernels of `portable::mx_quantize` / `portable::mx_dequantize`; the Triton kernels of the
cuda backend are checked against them bit for bit.

    formats.py   the element formats (E4M3, E5M2, E3M2, E2M3, E2M1, MXINT8) as data
    scale.py     E8M0 scale rules (floor, rceil, ceil, even, emax) from exponent bits
    elements.py  element rounding (nearest even, subnormals, saturation) and decode tables
    pack.py      FP4 two-per-byte packing
    layout.py    argument checks; the [outer, axis, inner] block layout
    tables.py    lookup tables of scale.py's and elements.py's formulas, for the CPU kernels
    codec.py     quantize / dequantize
    swizzle.py   the Blackwell 128x4 swizzled scale layout
    vectors.py   test data for every implementation: mx.md's vectors, seeded adversarial inputs
"""

from __future__ import annotations

from .codec import dequantize, quantize
from .formats import FORMATS, SCALE_RULES, MXFormat, get_format
from .layout import BlockLayout, check_dequantize, check_quantize, dequantize_layout
from .pack import pack_fp4, unpack_fp4
from .swizzle import swizzle_scales, unswizzle_scales

__all__ = [
    "FORMATS",
    "SCALE_RULES",
    "BlockLayout",
    "MXFormat",
    "check_dequantize",
    "check_quantize",
    "dequantize",
    "dequantize_layout",
    "get_format",
    "pack_fp4",
    "quantize",
    "swizzle_scales",
    "unpack_fp4",
    "unswizzle_scales",
]
