"""Test data for every MX implementation: the vectors of shared/reference/mx.md, and seeded
adversarial inputs (`fuzz`).

Each vector is one block of 32 fp32 inputs (`values`, then zeros), quantized along the last axis
with each of `formats` x `rules`. Expected: the E8M0 byte, a prefix of the element codes (4-bit
codes unpacked), and where mx.md gives them a prefix of the dequantized values (NaN: NaN).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["VECTORS", "Vector", "cases", "edge_blocks", "fuzz"]

NAN = float("nan")
INF = float("inf")
ALL_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8")
ALL_RULES = ("floor", "rceil", "ceil", "even")
FLOOR_RCEIL = ("floor", "rceil")


@dataclasses.dataclass(frozen=True)
class Vector:
    id: str  # mx.md's number (and rule, where one input has a row per rule)
    values: tuple[float, ...]  # the block's first elements; the rest are 0
    formats: tuple[str, ...]
    rules: tuple[str, ...]
    byte: int
    codes: tuple[int, ...] = ()
    dequant: tuple[float, ...] = ()

    def block(self) -> list[float]:
        return list(self.values) + [0.0] * (32 - len(self.values))


VECTORS = (
    Vector("1", (), ("e4m3",), FLOOR_RCEIL, 0, (0,) * 32, (0.0,) * 32),
    Vector("2", (1.0, 0.5, -0.25, 0.1), ("e4m3",), FLOOR_RCEIL, 119,
           (0x78, 0x70, 0xE8, 0x5D), (1.0, 0.5, -0.25, 0.1015625)),
    Vector("3", (6.0, -3.0, 0.5, 0.2), ("e2m1",), FLOOR_RCEIL, 127, (7, 0xD, 1, 0)),
    Vector("4", (7.0, 3.0, -6.5, 1.0), ("e2m1",), ("floor",), 127, (7, 5, 0xF, 2),
           (6.0, 3.0, -6.0, 1.0)),
    Vector("5", (7.0, 3.0, -6.5, 1.0), ("e2m1",), ("rceil",), 128, (6, 3, 0xD, 1),
           (8.0, 3.0, -6.0, 1.0)),
    Vector("6-floor", (480.0,) * 32, ("e4m3",), ("floor",), 127, (0x7E,) * 32, (448.0,) * 32),
    Vector("6-rceil", (480.0,) * 32, ("e4m3",), ("rceil",), 128, (0x77,) * 32),
    Vector("7", (56.0, 1.0), ("e4m3",), ("rceil",), 124, (0x7E, 0x50)),
    Vector("8", (NAN, 1.0, 2.0, 3.0), ALL_FORMATS, ALL_RULES, 255, (), (NAN,) * 32),
    Vector("9", (INF, 1.0, 2.0, 3.0), ("e4m3",), ALL_RULES, 255, (), (NAN,) * 32),
    Vector("10", (2.0**-126,) * 32, ("e4m3",), FLOOR_RCEIL, 0, (0x40,) * 32),
    Vector("11", (2.0**-149, 2.0**-135, 2.0**-130, -(2.0**-128)), ("e4m3",), ("floor",), 0,
           (0x00, 0x02, 0x20, 0xB0)),
    Vector("12", (-(2.0**-149),) + (1.0,) * 31, ("e4m3",), ("floor",), 119, (0x80,)),
    Vector("13", (1.0, 2.0**-16, 3 * 2.0**-18, 2.0**-17, 5 * 2.0**-19, 2.0**-18), ("e4m3",),
           ("floor",), 119, (0x78, 0x02, 0x02, 0x01, 0x01, 0x00)),
    Vector("14", (4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), ("e2m1",), ("floor",), 127,
           (6, 0, 2, 2, 4, 4, 6, 6)),
    Vector("15", (4.0, -0.0, -0.2, -0.26), ("e2m1",), ("floor",), 127, (6, 8, 8, 9)),
    Vector("16", (485.0, 475.0, 400.0, -485.0, -475.0, -450.0, 2.0**-6, -(2.0**-6)), ("e4m3",),
           ("floor",), 127, (), (448.0, 448.0, 384.0, -448.0, -448.0, -448.0, 2.0**-6, -(2.0**-6))),
    Vector("17", (61440.0, 1.0), ("e5m2",), ("floor",), 127, (0x7B,)),
)  # fmt: skip


def cases() -> list[tuple[Vector, str, str]]:
    """(vector, format, rule) for every combination the vectors list."""
    return [(v, f, r) for v in VECTORS for f in v.formats for r in v.rules]


def fuzz(seed: int, rows: int, cols: int = 32, specials: bool = True) -> torch.Tensor:
    """fp32 [rows, cols] blocks over the whole fp32 range: wide dynamic range inside a block,
    exact ties of every format's grid, fp32 subnormals, zero blocks, signed zeros and (with
    `specials`) NaN / +-Inf in some blocks."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=g)

    kind = ints(0, 8, (rows, 1))
    base = ints(-150, 126, (rows, 1)).double()
    sign = ints(0, 2, (rows, cols)).double() * 2 - 1
    mant = torch.rand(rows, cols, generator=g, dtype=torch.float64) + 1
    wide = sign * mant * torch.exp2(base + ints(-24, 1, (rows, cols)))
    ties = sign * ints(0, 129, (rows, cols)) * torch.exp2(base - 4)  # on-grid and midpoints
    x = torch.where(kind == 1, ties, wide)
    x = torch.where(kind == 2, 0.0 * sign, x)  # all-zero blocks, signed zeros
    x = torch.where(ints(0, 10, (rows, cols)) == 0, 0.0 * sign, x).float()
    if specials:
        special = torch.tensor([float("nan"), float("inf"), -float("inf")])[ints(0, 3, (rows,))]
        col = ints(0, cols, (rows,))
        hit = (kind == 3).flatten()
        x[hit, col[hit]] = special[hit]
    return x


def edge_blocks() -> torch.Tensor:
    """fp32 [n, 32] blocks whose amax sits on (or one ulp beside) every threshold of the scale
    rules: zero and subnormal amax around 2^-127 and 2^-126, powers of two, the mantissa carry
    points of the even rule for every mantissa width, fp32 max, and `max * 2^k` for every
    format's max (where rceil's `amax / max` crosses a power of two)."""
    bits = [0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF, 0x800000, 0x800001, 0x7F7FFFFF]
    for mbits in (1, 2, 3, 6):
        for exponent in (0, 1, 127, 254):
            carry = (exponent << 23) | (0x800000 - (1 << (22 - mbits)))
            subnormal_carry = 0x800000 - (1 << (21 - mbits))
            bits += [carry - 1, carry, subnormal_carry - 1, subnormal_carry]
    for exponent in (1, 2, 100, 127, 128, 200, 253, 254):
        bits += [(exponent << 23) - 1, exponent << 23, (exponent << 23) + 1]
    for max_value in (448.0, 57344.0, 28.0, 7.5, 6.0, 127 / 64):
        for k in (-150, -136, -133, -130, -128, -127, -126, -100, 0, 60, 119, 125):
            center = torch.tensor(max_value * 2.0**k, dtype=torch.float32).view(torch.int32)
            bits += [int(center) + d for d in (-2, -1, 0, 1, 2)]
    amax = torch.tensor(sorted(set(b for b in bits if 0 <= b < 0x7F800000)), dtype=torch.int32)
    amax = amax.view(torch.float32)
    fractions = torch.linspace(-1, 1, 32, dtype=torch.float64)
    blocks = (amax.double()[:, None] * fractions).float()  # |x| <= amax, rounding included
    blocks[:, -1] = amax
    blocks[1::2, -1] *= -1
    return blocks
