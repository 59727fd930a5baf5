"""The MX element formats: one frozen record of numeric facts per format (shared/reference/mx.md).

Every float format is sign-magnitude: a code is `sign << (bits - 1) | magnitude`, and the
magnitude code `e << mbits | m` is worth `(e ? 2^mbits + m : m) * 2^(max(e, 1) - bias - mbits)`.
MXINT8 (int8 x 2^-6) fits the same rule: its magnitude 0..127 is an E1M6 code with bias 1
(`c / 64` exactly), but negative values are two's complement bytes, not a sign bit; it
saturates to +-127, so the byte 0x80 (-128, decoded as -2) is never produced.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from portable.errors import InputError

__all__ = ["FORMATS", "MXFormat", "SCALE_RULES", "get_format"]

SCALE_RULES = ("floor", "rceil", "ceil", "even", "emax")


@dataclasses.dataclass(frozen=True)
class MXFormat:
    """Numeric facts of one element format.

    `emax` is the exponent of the largest power of two; `max_code` the largest finite magnitude
    code (its value is `max_value`); `specials` is "nan" (E4M3: magnitude 0x7F), "inf+nan"
    (E5M2: exponent field all ones) or "none". `torch_dtype` is set where torch has the element
    dtype (its cast is round-to-nearest-even with subnormals, not saturating)."""

    name: str
    bits: int  # code width: 8, 6 or 4 (4-bit codes are packed two per byte)
    mbits: int  # mantissa bits (6 for MXINT8's E1M6 view)
    bias: int
    emax: int
    max_value: float
    max_code: int
    integer: bool = False
    specials: str = "none"
    torch_dtype: torch.dtype | None = None
    ml_dtype: str | None = None  # the `ml_dtypes` element type, the tests' independent oracle

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal power of two."""
        return 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def packed(self) -> bool:
        """Two codes per byte along the quantized axis, element 2i in the low nibble."""
        return self.bits == 4

    @property
    def inv_max_bits(self) -> int:
        """fp32 bits of fp32(1 / max_value), correctly rounded (the rceil rule's constant)."""
        inv = np.float32(1.0) / np.float32(self.max_value)
        return int(np.array(inv, dtype=np.float32).view(np.int32))

    def magnitude_value(self, code: int) -> float:
        """The exact value of a finite magnitude code."""
        e, m = code >> self.mbits, code & ((1 << self.mbits) - 1)
        significand = (1 << self.mbits) + m if e else m
        return significand * 2.0 ** (max(e, 1) - self.bias - self.mbits)


FORMATS: dict[str, MXFormat] = {
    f.name: f
    for f in (
        MXFormat("e4m3", 8, 3, 7, 8, 448.0, 0x7E, specials="nan",
                 torch_dtype=torch.float8_e4m3fn, ml_dtype="float8_e4m3fn"),
        MXFormat("e5m2", 8, 2, 15, 15, 57344.0, 0x7B, specials="inf+nan",
                 torch_dtype=torch.float8_e5m2, ml_dtype="float8_e5m2"),
        MXFormat("e3m2", 6, 2, 3, 4, 28.0, 0x1F, ml_dtype="float6_e3m2fn"),
        MXFormat("e2m3", 6, 3, 1, 2, 7.5, 0x1F, ml_dtype="float6_e2m3fn"),
        MXFormat("e2m1", 4, 1, 1, 2, 6.0, 0x7, ml_dtype="float4_e2m1fn"),
        MXFormat("int8", 8, 6, 1, 0, 127 / 64, 127, integer=True),
    )
}  # fmt: skip


def get_format(name: str) -> MXFormat:
    """The format called `name`; InputError naming the valid ones otherwise."""
    fmt = FORMATS.get(name)
    if fmt is None:
        raise InputError(f"unknown MX format {name!r}", fix=f"use one of: {', '.join(FORMATS)}")
    return fmt
