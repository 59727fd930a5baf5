"""Element codes: scaled fp32 values -> codes (round to nearest even, saturate), and back.

`encode` takes `y = x * 2^(127 - b)`, which is exact wherever it is an fp32 normal (a power-of-two
scaling); values below 2^-126 round to a zero code in every format, so the rounding of a
subnormal product never shows. The magnitude is rounded in one of two ways, which agree bit for
bit (the tests check it):

- torch's fp32 -> float8 cast (E4M3, E5M2): round to nearest even with subnormals, after clamping
  to +-max because the cast does not saturate (it gives NaN or Inf);
- integer arithmetic on the fp32 bits (every format): above 2^emin, round the mantissa to
  `mbits` bits (`(a + 2^(22-mbits) - 1 + lsb) >> (23 - mbits)`, carry included) and rebase the
  exponent; below, the format's subnormal grid 2^(emin - mbits) is reached exactly by adding the
  magic number 2^(emin - mbits + 23) (whose binade has that spacing) in fp32. The Triton kernel
  uses one integer formula for both ranges instead (no float add).

The sign comes from the input's sign bit, so signed zeros are kept (-tiny -> 0x80 in E4M3);
MXINT8 negates in two's complement instead (int8 has no -0).
"""

from __future__ import annotations

import functools

import torch

from .formats import MXFormat
from .pack import pack_fp4

__all__ = ["decode_pairs", "decode_table", "encode", "encode_integer_path"]


def _magnitudes(y: torch.Tensor, fmt: MXFormat, a: torch.Tensor, work: torch.Tensor) -> None:
    """Rounded, saturated magnitude codes of fp32 `y` into int32 `work`; `a` is int32 scratch
    (all of `y`'s shape). Overwrites `y`.

    Both roundings are evaluated on every element, each on |y| clamped to its side of
    `lim = 2^emin`, where both give the code of 2^emin (`1 << mbits`): so the code is
    `normal(max(|y|, lim)) + subnormal(min(|y|, lim)) - (1 << mbits)`, with no select."""
    m, shift = fmt.mbits, 23 - fmt.mbits
    lim = (127 + fmt.emin) << 23
    magic_bits = (127 + fmt.emin - m + 23) << 23  # 2^(emin - m + 23): ulp 2^(emin - m)
    magic = torch.tensor(magic_bits, dtype=torch.int32).view(torch.float32)
    torch.bitwise_and(y.view(torch.int32), 0x7FFFFFFF, out=a)
    # below 2^emin: the subnormal grid, reached by an fp32 add of the magic number
    torch.clamp(a, max=lim, out=work)
    sub = torch.add(work.view(torch.float32), magic, out=y).view(torch.int32)
    sub.sub_(magic_bits + (1 << m))
    # above 2^emin: round the mantissa to m bits (nearest even; the carry may bump the
    # exponent), then rebase the exponent: code = ((a + 2^(shift-1) - 1 + lsb) >> shift) - off
    a.clamp_(min=lim)
    torch.bitwise_right_shift(a, shift, out=work)
    offset = ((126 + fmt.emin) << m) << shift
    work.bitwise_and_(1).add_(a).add_((1 << (shift - 1)) - 1 - offset).bitwise_right_shift_(shift)
    work.add_(sub).clamp_(max=fmt.max_code)


def _apply_sign(codes: torch.Tensor, x_bits: torch.Tensor, fmt: MXFormat, a: torch.Tensor) -> None:
    """Give int32 magnitude `codes` the sign of `x_bits` (in place); `a` is int32 scratch."""
    if fmt.integer:  # two's complement: (c ^ s) - s with s = 0 or -1
        torch.bitwise_right_shift(x_bits, 31, out=a)
        codes.bitwise_xor_(a).sub_(a)
    else:  # the sign bit lands on bit (bits - 1) by an arithmetic shift
        torch.bitwise_right_shift(x_bits, 32 - fmt.bits, out=a)
        codes.bitwise_or_(a.bitwise_and_(fmt.sign_bit))


def encode_integer_path(
    y: torch.Tensor, x_bits: torch.Tensor, fmt: MXFormat, a: torch.Tensor, work: torch.Tensor
) -> torch.Tensor:
    """int32 codes (0..255, or -127..127 for MXINT8) of scaled fp32 `y` with the signs of int32
    `x_bits`, by integer arithmetic, in `work`. `a`, `work`: int32 scratch of `y`'s shape;
    `y` is overwritten."""
    _magnitudes(y, fmt, a, work)
    _apply_sign(work, x_bits, fmt, a)
    return work


def encode(
    y: torch.Tensor, x_bits: torch.Tensor, fmt: MXFormat, out: torch.Tensor,
    a: torch.Tensor, work: torch.Tensor,
) -> None:  # fmt: skip
    """Write the codes of scaled fp32 `y` (signs from int32 `x_bits`) into `out`: uint8 of
    `y`'s shape, or of half its dim 1 for packed FP4 (element 2i in the low nibble). `a` and
    `work` are int32 scratch of `y`'s shape; `y` is overwritten."""
    if fmt.torch_dtype is not None:
        y.clamp_(-fmt.max_value, fmt.max_value)
        out.view(fmt.torch_dtype).copy_(y)
        return
    codes = encode_integer_path(y, x_bits, fmt, a, work)
    if fmt.packed:
        codes = pack_fp4(codes, dim=1)
    elif fmt.integer:
        out = out.view(torch.int8)
    out.copy_(codes)


@functools.cache
def decode_table(fmt: MXFormat) -> torch.Tensor:
    """fp32 value of every code byte: shape [256], or [256, 2] (low, high nibble) for packed
    FP4. Bits above a 6-bit code are ignored; E4M3 magnitude 0x7F is NaN; E5M2 exponent 31 is
    Inf / NaN; MXINT8 bytes are int8 / 64."""
    byte = torch.arange(256, dtype=torch.int32)
    if fmt.packed:
        return torch.stack([_values(byte & 0xF, fmt), _values(byte >> 4, fmt)], dim=1)
    return _values(byte, fmt)


@functools.cache
def decode_pairs(fmt: MXFormat) -> torch.Tensor:
    """int64 whose two fp32 halves (low first, as in memory) are the values of two elements:
    of the code bytes `k & 0xFF` and `k >> 8` for 8-bit keys k (uint16 pairs of codes), [65536];
    of the FP4 byte k's low and high nibble, [256]."""
    table = decode_table(fmt)
    if not fmt.packed:
        table = torch.stack([table.repeat(256), table.repeat_interleave(256)], dim=1)
    return table.contiguous().view(torch.int64).view(-1)


def _values(code: torch.Tensor, fmt: MXFormat) -> torch.Tensor:
    if fmt.integer:
        return ((code ^ 0x80) - 0x80).to(torch.float32) / 64  # the byte as int8, / 64
    code = code & ((1 << fmt.bits) - 1)
    mag = code & (fmt.sign_bit - 1)
    e, m = mag >> fmt.mbits, mag & ((1 << fmt.mbits) - 1)
    significand = torch.where(e > 0, m + (1 << fmt.mbits), m).to(torch.float64)
    value = torch.ldexp(significand, e.clamp(min=1) - fmt.bias - fmt.mbits).to(torch.float32)
    if fmt.specials == "nan":
        value[mag == (fmt.sign_bit - 1)] = float("nan")
    elif fmt.specials == "inf+nan":
        top = e == (1 << (fmt.bits - 1 - fmt.mbits)) - 1
        value[top] = torch.where(m[top] == 0, float("inf"), float("nan"))
    return torch.where(code & fmt.sign_bit != 0, -value, value)
