"""E8M0 block scales: the scale rules, and scale bytes as exact fp32 values.

A scale byte `b` is worth `2^(b - 127)`; 255 is NaN. Every rule works on the fp32 bits of the
block's amax (`|x|` bits, so NaN > +Inf > every finite value as int32) and never calls log2:

    floor  b = max(E(amax) - emax, 0)                 E() = biased exponent field
    ceil   b = min(max(C(amax) - emax, 0), 254)       C(v) = smallest b with 2^(b-127) >= v
    rceil  b = min(C(fp32(amax * fp32(1/max))), 254)  (NVIDIA's rule: never clips)
    even   b = min(max(E(R(amax)) - emax, 0), 254)    R() rounds to mbits mantissa, ties up
                                                      (MXINT8 counts as E1M6: mbits 6)
    emax   b = min(max(F(amax) - emax + 1, 0), 254)   F(v) = floor(log2 v) + 127: E(v), and
                                                      -1 below 2^-127 (zero too; the same byte)

emax is Trainium3's QuantizeMX "EMAX" (NKI `quantize_mx`): the smallest b with
`amax < 2^emax * 2^(b - 127)` (clamped to [0, 254]), i.e. floor's scale doubled wherever floor's
byte is not clamped. Every scaled element is then below 2^emax, which rounds to at most
2^emax <= max: no element saturates, except MXINT8 (emax 0) blocks with amax >= 2^127, where
b stops at 254. Reachable bytes: 0 to 255 - emax (254 for MXINT8). F() instead of E() changes
a byte only for MXINT8: a subnormal amax below 2^-127 (and zero) gives 0, from 2^-127 on 1.
Inputs are fp32, or bf16 / f16 read as their exact fp32 upcast (the hardware's inputs).

A block whose amax is Inf or NaN gets 255 and dequantizes to NaN (the spec's NaN scale;
Transformer Engine instead saturates Inf to +-max with b = 254). An all-zero block gets 0 under
every rule.
"""

from __future__ import annotations

import torch

from .formats import MXFormat

__all__ = ["ceil_byte", "even_exponent", "reciprocal_scales", "scale_bytes", "scale_values"]

ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000
NAN_BITS = 0x7FC00000
SCALE_MIN_BITS = 0x00400000  # 2^-127, the value of byte 0: an fp32 subnormal


def ceil_byte(bits: torch.Tensor) -> torch.Tensor:
    """Smallest b in [0, 255] with 2^(b - 127) >= v, for the bits of finite v >= 0.

    Normal v: its exponent field, plus 1 unless v is a power of two. Subnormal v: 0 up to
    2^-127 (mantissa 0x400000), else 1."""
    normal = (bits + 0x7FFFFF) >> 23
    return torch.where(bits < 0x800000, (bits > SCALE_MIN_BITS).to(torch.int32), normal)


def even_exponent(bits: torch.Tensor, mbits: int) -> torch.Tensor:
    """Exponent field of finite v >= 0 rounded to `mbits` mantissa bits, ties up (the carry
    bumps it). A subnormal v is rounded by its value: it reaches 2^-126 (field 1) from
    2^-126 - 2^(-128 - mbits), half of its binade's spacing below (a plain add of
    2^(22 - mbits) to the bits would round it twice as coarsely; only MXINT8, emax 0, sees it)."""
    subnormal = (bits < 0x800000).to(torch.int32)
    return (bits + ((1 << (22 - mbits)) >> subnormal)) >> 23


def scale_bytes(amax_bits: torch.Tensor, fmt: MXFormat, rule: str) -> torch.Tensor:
    """int32 scale bytes (0..255) of blocks whose amax has the int32 fp32 bits `amax_bits`."""
    if rule == "floor":
        b = ((amax_bits >> 23) - fmt.emax).clamp_(0, 254)
    elif rule == "ceil":
        b = (ceil_byte(amax_bits) - fmt.emax).clamp_(0, 254)
    elif rule == "rceil":
        inv = torch.tensor(fmt.inv_max_bits, dtype=torch.int32).view(torch.float32)
        d = (amax_bits.view(torch.float32) * inv).view(torch.int32)
        b = ceil_byte(d).clamp_(max=254)
    elif rule == "even":
        b = (even_exponent(amax_bits, fmt.mbits) - fmt.emax).clamp_(0, 254)
    elif rule == "emax":  # F(amax) = E(amax) - (amax < 2^-127)
        below = (amax_bits < SCALE_MIN_BITS).to(torch.int32)
        b = ((amax_bits >> 23) - below).sub_(fmt.emax - 1).clamp_(0, 254)
    else:
        raise ValueError(rule)
    return b.masked_fill_(amax_bits >= INF_BITS, 255)


def scale_values(b: torch.Tensor) -> torch.Tensor:
    """fp32 `2^(b - 127)` of int32 scale bytes, exactly (byte 0 is subnormal, 255 is NaN)."""
    bits = torch.where(b == 0, SCALE_MIN_BITS, b << 23)
    return bits.masked_fill_(b == 255, NAN_BITS).view(torch.float32)


def reciprocal_scales(b: torch.Tensor) -> torch.Tensor:
    """fp32 `2^(127 - b)` of int32 scale bytes, exactly (byte 254 gives the subnormal 2^-127;
    255, a NaN block whose codes are discarded, gives 1)."""
    bits = torch.where(b == 254, SCALE_MIN_BITS, (254 - b) << 23)
    return bits.masked_fill_(b == 255, 0x3F800000).view(torch.float32)
