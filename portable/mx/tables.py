"""Lookup tables that the CPU kernels index instead of evaluating `scale.py` / `elements.py`
per value: each is those formulas evaluated once on one representative of every key, where a
key is the few high bits of an fp32 value that decide the result.

Scale bytes. Each rule reads a prefix of the amax bits `a` (NaN / Inf blocks are fixed by the
caller: their bytes here are unspecified):

    floor  key = a >> 23                  the exponent field
    emax   key = a >> 22                  the field, and 2^-127 <= a for subnormals
    even   key = a >> (21 - mbits)        the bits the rounding carry depends on (a subnormal
                                          rounds at half the spacing: one bit more)
    ceil   key = (a + 0x3FFFFF) >> 22     2E + (0, 1 or 2): C(a) = E + (mantissa != 0) is
    rceil  the same key of d = fp32(a * fp32(1/max))   (key + 1) >> 1, 0 for keys 0 and 1

(ceil and rceil read `min(a, Inf)`, so the sum stays in int32.) A table holds the byte and its
exact reciprocal scale `2^(127 - b)` per key.

Element codes (E3M2, E2M3, E2M1: `mbits <= 3`). Rounding to nearest even at `mbits` mantissa
bits depends on the bits down to the round bit and on whether any lower bit is set (sticky).
The high 16 bits of an fp32 value hold the sign, the exponent and 7 mantissa bits, so the round
bit of these formats is among them, above bit 16; folding "any of bits 0..15 is set" into bit 16
(round to odd at 7 bits) keeps every rounding decision. The table maps that 16-bit key to the
code, saturation and sign included; values below the format's subnormal grid and fp32
subnormals round through the same key. MXINT8 (7 significant bits) and the float8 formats do
not use it.
"""

from __future__ import annotations

import functools

import torch

from .elements import encode_integer_path
from .formats import MXFormat
from .scale import INF_BITS, ceil_byte, reciprocal_scales, scale_bytes

__all__ = ["encode_keys", "encode_table", "scale_keys", "scale_table", "uses_encode_table"]


def _shift(fmt: MXFormat, rule: str) -> int:
    return {"floor": 23, "emax": 22, "even": 21 - fmt.mbits}.get(rule, 22)


def scale_keys(amax_bits: torch.Tensor, fmt: MXFormat, rule: str) -> torch.Tensor:
    """int32 keys into `scale_table(fmt, rule)` of int32 amax bits (module docstring)."""
    if rule in ("ceil", "rceil"):
        a = amax_bits.clamp(max=INF_BITS)
        if rule == "rceil":
            inv = torch.tensor(fmt.inv_max_bits, dtype=torch.int32).view(torch.float32)
            a = a.view(torch.float32).mul_(inv).view(torch.int32)
        return a.add_(0x3FFFFF).bitwise_right_shift_(22)
    return amax_bits >> _shift(fmt, rule)


@functools.cache
def scale_table(fmt: MXFormat, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 bytes, float32 reciprocal scales) of every key of `scale_keys`."""
    if rule in ("ceil", "rceil"):  # C(rep) = (k + 1) >> 1 for k >= 2, 0 for k < 2, all finite
        k = torch.arange(511, dtype=torch.int32)
        half = k >> 1
        rep = torch.where(k % 2 == 1, (half << 23) + 1, ((half - 1) << 23) | 0x7FFFFF)
        rep = torch.where(k == 0, 0, rep)
        if rule == "ceil":
            b = scale_bytes(rep, fmt, "ceil")
        else:
            b = ceil_byte(rep).clamp_(max=254)
    else:
        shift = _shift(fmt, rule)
        b = scale_bytes(torch.arange(1 << (31 - shift), dtype=torch.int32) << shift, fmt, rule)
    return b.to(torch.uint8), reciprocal_scales(b)


def uses_encode_table(fmt: MXFormat) -> bool:
    """Whether `encode_table` serves `fmt` (floats of at most 3 mantissa bits without a torch
    dtype: E3M2, E2M3, E2M1)."""
    return not fmt.integer and fmt.torch_dtype is None and fmt.mbits <= 3


def encode_keys(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """int32 keys into `encode_table` of int32 fp32 bits, written to `out` (bits' shape)."""
    # bits 0..15 + 0xFFFF carries into bit 16 iff one of them is set; bits 17.. are untouched
    torch.bitwise_and(bits, 0xFFFF, out=out).add_(0xFFFF).bitwise_or_(bits)
    return out.bitwise_right_shift_(16).bitwise_and_(0xFFFF)


@functools.cache
def encode_table(fmt: MXFormat, shift: int = 0) -> torch.Tensor:
    """uint8 `code << shift` of every 16-bit key (module docstring): [65536]."""
    bits = torch.arange(1 << 16, dtype=torch.int32) << 16
    y = bits.view(torch.float32).clone()
    a, work = torch.empty_like(bits), torch.empty_like(bits)
    codes = encode_integer_path(y, bits, fmt, a, work)
    return ((codes << shift) & 0xFF).to(torch.uint8)
