"""Test data for every MX implementation: the vectors of shared/reference/mx.md (and, in the
same style, of the emax rule), and seeded adversarial inputs (`fuzz`, `edge_blocks`,
`scale_sweep`).

Each vector is one block of 32 fp32 inputs (`values`, then zeros), quantized along the last axis
with each of `formats` x `rules`. Expected: the E8M0 byte, a prefix of the element codes (4-bit
codes unpacked), and where mx.md gives them a prefix of the dequantized values (NaN: NaN).
The `emax` rows are worked by hand from `portable.mx.scale`'s definition (b = floor(log2 amax)
+ 128 - emax, clamped to [0, 254]): e.g. 480 = 1.875 * 2^8 in E4M3 gets b = 135 - 8 + 1 = 128
and the element 240 (code 0x77), where floor saturates it to 448.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["VECTORS", "Vector", "cases", "edge_blocks", "fuzz", "scale_sweep"]

NAN = float("nan")
INF = float("inf")
ALL_FORMATS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8")
ALL_RULES = ("floor", "rceil", "ceil", "even", "emax")
FLOOR_RCEIL = ("floor", "rceil")
EMAX = ("emax",)


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
    Vector("1", (), ("e4m3",), (*FLOOR_RCEIL, "emax"), 0, (0,) * 32, (0.0,) * 32),
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
    Vector("10", (2.0**-126,) * 32, ("e4m3",), (*FLOOR_RCEIL, "emax"), 0, (0x40,) * 32),
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
    # the emax rule (Trainium3's QuantizeMX "EMAX"): floor's scale doubled, never saturates
    Vector("2-emax", (1.0, 0.5, -0.25, 0.1), ("e4m3",), EMAX, 120, (0x70, 0x68, 0xE0, 0x55),
           (1.0, 0.5, -0.25, 0.1015625)),
    Vector("5-emax", (7.0, 3.0, -6.5, 1.0), ("e2m1",), EMAX, 128, (6, 3, 0xD, 1),
           (8.0, 3.0, -6.0, 1.0)),
    Vector("6-emax", (480.0,) * 32, ("e4m3",), EMAX, 128, (0x77,) * 32, (480.0,) * 32),
    Vector("16-emax", (464.0, 1.0), ("e4m3",), EMAX, 128, (0x76, 0x30), (448.0, 1.0)),
    Vector("17-emax", (61440.0, 1.0), ("e5m2",), EMAX, 128, (0x78, 0x38), (65536.0, 1.0)),
    Vector("e2m1-max-emax", (6.0, -0.25), ("e2m1",), EMAX, 128, (5, 8), (6.0, -0.0)),
    Vector("int8-tiny-emax", (2.0**-128, -(2.0**-133)), ("int8",), EMAX, 0, (0x20, 0xFF),
           (2.0**-128, -(2.0**-133))),
    Vector("int8-2^-127-emax", (2.0**-127,), ("int8",), EMAX, 1, (0x20,), (2.0**-127,)),
    Vector("int8-top-emax", (1.9921875 * 2.0**127, 1.5 * 2.0**127), ("int8",), EMAX, 254,
           (0x7F, 0x60), (127 / 64 * 2.0**127, 1.5 * 2.0**127)),
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


# (mantissa bits, exponent bias) of the input dtypes
_INPUT_DTYPES = {torch.float32: (23, 127), torch.bfloat16: (7, 127), torch.float16: (10, 15)}


def scale_sweep(
    dtype: torch.dtype = torch.float32, rows: int = 2048, seed: int = 0
) -> torch.Tensor:
    """[rows, 32] blocks of `dtype` whose amax walks every binade of `dtype`, subnormal ones
    included, with the mantissas where a format's rounding or saturation changes (1, 1.5, 1.75,
    1.875, 1 + 63/64, the largest), so every format meets every scale byte it can reach under
    every rule; then blocks of special values (NaN, +-Inf, all +0 / -0, the dtype's largest
    magnitude, amax one ulp around 2^-127); then random amax. The other elements are random
    below amax (8 random mantissa bits, so ties of every element grid, 0 to 40 binades lower:
    element and fp32 subnormals) with random signs and signed zeros; amax sits at a varying
    position and sign. `rows` must hold the sweep (at least 1700 for float32)."""
    p, bias = _INPUT_DTYPES[dtype]
    g = torch.Generator().manual_seed(seed)
    tiny, top = 1 - bias - p, bias  # exponents of the smallest subnormal and the largest binade
    mants = torch.tensor([1.0, 1.5, 1.75, 1.875, 1 + 63 / 64, 2 - 2.0**-p], dtype=torch.float64)
    exps = torch.arange(tiny, top + 1, dtype=torch.float64)
    sweep = (mants[None, :] * torch.exp2(exps[:, None])).flatten()
    ulp = 2.0**tiny
    edges = [2.0**-127 - ulp, 2.0**-127, 2.0**-127 + ulp, 2.0**tiny, (2 - 2.0**-p) * 2.0**top]
    n_random = rows - len(sweep) - len(edges) - len(_SPECIAL_ROWS)
    if n_random < 0:
        raise ValueError(f"scale_sweep needs rows >= {rows - n_random} for {dtype}")
    random_exp = torch.randint(tiny, top + 1, (n_random,), generator=g).double()
    random_amax = (1 + torch.rand(n_random, generator=g, dtype=torch.float64)) * torch.exp2(
        random_exp
    )
    amax = torch.cat([sweep, torch.tensor(edges, dtype=torch.float64), random_amax])
    amax = amax.clamp(max=(2 - 2.0**-p) * 2.0**top)
    n = len(amax)
    sign = torch.randint(0, 2, (n, 32), generator=g).double() * 2 - 1
    mant = 1 + torch.randint(0, 256, (n, 32), generator=g).double() / 256
    drop = torch.randint(0, 41, (n, 32), generator=g).double()
    x = sign * torch.minimum(mant * torch.exp2(torch.floor(torch.log2(amax))[:, None] - drop),
                             amax[:, None])  # fmt: skip
    x = torch.where(torch.randint(0, 8, (n, 32), generator=g) == 0, 0.0 * sign, x)
    where = torch.arange(n) % 32
    x[torch.arange(n), where] = amax * torch.where(torch.arange(n) % 3 == 0, -1.0, 1.0)
    special = torch.tensor(_SPECIAL_ROWS, dtype=torch.float64)
    special = torch.where(special.abs() == _MAX, special.sign() * (2 - 2.0**-p) * 2.0**top, special)
    return torch.cat([x, special]).to(dtype)


_MAX = 1e300  # placeholder in _SPECIAL_ROWS for the dtype's largest finite magnitude
_SPECIAL_ROWS = [
    [NAN] + [1.0] * 31,
    [2.0, INF] + [-3.0] * 30,
    [-INF] + [0.0] * 31,
    [NAN, INF, -INF] + [_MAX] * 29,
    [0.0] * 31 + [NAN],
    [0.0] * 32,
    [-0.0] * 32,
    [0.0, -0.0] * 16,
    [_MAX, -_MAX] * 16,
    [-_MAX] + [1.0] * 31,
]
