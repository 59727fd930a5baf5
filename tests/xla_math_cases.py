"""The `xla` rule table's cases, part 3: elementwise math beyond arithmetic (rules/math.py) and
flips (rules/sorting.py). Builders and `Case` are in tests/xla_cases.py."""

from __future__ import annotations

import torch
from xla_cases import BF16, BOOL, F32, FLOATS, I64, A, C, pos, small, t

FLOATS_INT = (F32, BF16, I64)


def halves(dtype, *shape):
    """Values on and near .5 ties (exact in bfloat16), of both signs: round-half-to-even."""
    base = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -3.25, 0.25, 1.75, -0.0, 0.0])
    n = 1
    for s in shape:
        n *= s
    return base.repeat(n // base.numel() + 1)[:n].reshape(shape).to(dtype)


def specials(dtype, *shape):
    """Normal values with inf, -inf and NaN mixed in."""
    x = t(dtype, *shape).flatten()
    x[0], x[1], x[2] = float("inf"), float("-inf"), float("nan")
    return x.reshape(shape)


def near0(dtype, *shape):
    """Small magnitudes where log1p/expm1 differ from log(1 + x)/exp(x) - 1."""
    return (torch.randn(shape) * 1e-3).to(dtype)


def unit(dtype, *shape):
    """Uniform in (-1, 1): the domain of asin, acos, atanh, erfinv."""
    return (torch.rand(shape) * 2 - 1).to(dtype)


def vals(dtype, *values):
    """Exactly these values (edges of a domain: poles, signed zeros, infinities)."""
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def nonzero(dtype, *shape):
    """Divisors of both signs, never 0 (integer division by zero is an error in eager)."""
    sign = torch.randint(0, 2, shape) * 2 - 1
    if not dtype.is_floating_point:
        return (torch.randint(1, 4, shape) * sign).to(dtype)
    return ((torch.rand(shape) * 2 + 0.25) * sign).to(dtype)


_INF, _NAN = float("inf"), float("nan")
# lgamma/digamma poles and extremes: signed zeros, negative integers, infinities, NaN, huge
_GAMMA_EDGES = (0.0, -0.0, -1.0, -2.0, -7.0, 1.0, 2.0, 1e-30, -1e-30, 1e30, _INF, -_INF, _NAN)


_MATH = [
    C("aten.sign.default", lambda d: A(t(d, 3, 4)), FLOATS_INT),
    C("aten.sign.default", lambda d: A(specials(d, 3, 4)), (F32,), "special"),
    C("aten.log1p.default", lambda d: A(pos(d, 3, 4) - 0.4), (F32, BF16)),
    C("aten.log1p.default", lambda d: A(near0(d, 3, 4)), (F32,), "near0"),
    C("aten.expm1.default", lambda d: A(t(d, 3, 4)), (F32, BF16)),
    C("aten.expm1.default", lambda d: A(near0(d, 3, 4)), (F32,), "near0"),
    C("aten.log2.default", lambda d: A(pos(d, 3, 4)), (F32, BF16)),
    C("aten.log10.default", lambda d: A(pos(d, 3, 4)), (F32, BF16)),
    C("aten.floor.default", lambda d: A(t(d, 3, 4) * 3), FLOATS_INT),
    C("aten.ceil.default", lambda d: A(t(d, 3, 4) * 3), FLOATS_INT),
    C("aten.trunc.default", lambda d: A(t(d, 3, 4) * 3), FLOATS_INT),
    C("aten.round.default", lambda d: A(t(d, 3, 4) * 3), FLOATS_INT),
    C("aten.round.default", lambda d: A(halves(d, 3, 4)), (F32, BF16), "ties"),
    C("aten.round.decimals", lambda d: A(t(d, 3, 4) * 3, decimals=2), (F32, BF16)),
    C("aten.round.decimals", lambda d: A(t(d, 3, 4) * 300, decimals=-1), (F32, BF16), "negative"),
    C("aten.round.decimals", lambda d: A(halves(d, 3, 4), decimals=0), (F32,), "zero"),
    C("aten.isinf.default", lambda d: A(specials(d, 3, 4)), (F32, BF16)),
    C("aten.isinf.default", lambda d: A(t(d, 3, 4)), (I64,), "int"),
    C("aten.asin.default", lambda d: A(unit(d, 3, 4)), FLOATS),
    C("aten.asin.default", lambda d: A(vals(d, -1, 1, 1.5, -2, _NAN, 0)), (F32,), "domain"),
    C("aten.acos.default", lambda d: A(unit(d, 3, 4)), FLOATS),
    C("aten.acos.default", lambda d: A(vals(d, -1, 1, 1.5, -2, _NAN, 0)), (F32,), "domain"),
    C("aten.atan.default", lambda d: A(t(d, 3, 4) * 3), FLOATS),
    C("aten.atan.default", lambda d: A(specials(d, 3, 4)), (F32,), "special"),
    C("aten.atan2.default", lambda d: A(t(d, 3, 4), t(d, 4)), FLOATS),
    C(
        "aten.atan2.default",
        # y, x: every quadrant's signed zeros and infinities, as IEEE atan2 defines them
        lambda d: A(
            vals(d, 0, -0.0, 0, -0.0, 1, -1, _INF, _INF, -_INF, _NAN, 0, 5, -_INF, 2),
            vals(d, 0, 0, -0.0, -0.0, -_INF, -_INF, _INF, -_INF, 1, 1, -1, 0, -3, _NAN),
        ),
        (F32,),
        "signed_zeros",
    ),
    C("aten.sinh.default", lambda d: A(t(d, 3, 4) * 3), FLOATS),
    C(
        "aten.sinh.default",
        lambda d: A(vals(d, 1e-4, -1e-6, 20, -40, 88.5, 89.5, -_INF)),
        (F32,),
        "edge",
    ),
    C("aten.cosh.default", lambda d: A(t(d, 3, 4) * 3), FLOATS),
    C(
        "aten.cosh.default",
        lambda d: A(vals(d, 0, 1e-4, -20, 88.5, 89.5, -_INF, _NAN)),
        (F32,),
        "edge",
    ),
    C("aten.tan.default", lambda d: A(t(d, 3, 4)), FLOATS),
    C("aten.asinh.default", lambda d: A(t(d, 3, 4) * 3), FLOATS),
    C("aten.asinh.default", lambda d: A(vals(d, 1e-6, -1e-3, 1e10, -1e30, _INF)), (F32,), "edge"),
    C("aten.acosh.default", lambda d: A(pos(d, 3, 4) + 0.5), FLOATS),
    C("aten.acosh.default", lambda d: A(vals(d, 1, 0.999, 0.5, -1, 1e30, _INF)), (F32,), "domain"),
    C("aten.atanh.default", lambda d: A(unit(d, 3, 4)), FLOATS),
    C("aten.atanh.default", lambda d: A(vals(d, 1, -1, 1.5, -2, 1e-6, 0.999999)), (F32,), "domain"),
    C("aten.erfc.default", lambda d: A(t(d, 3, 4) * 2), FLOATS),
    C("aten.erfc.default", lambda d: A(vals(d, 3, 5, 8, -3, -9, 0.5, _INF, -_INF)), (F32,), "tail"),
    C("aten.erfinv.default", lambda d: A(unit(d, 3, 4) * 0.99), FLOATS),
    C("aten.erfinv.default", lambda d: A(1 - torch.rand(3, 4).to(d) * 1e-3), (F32,), "near1"),
    C("aten.erfinv.default", lambda d: A(vals(d, 1, -1, 1.5, -2, 0, -0.0, _NAN)), (F32,), "domain"),
    C("aten.lgamma.default", lambda d: A(t(d, 3, 4) * 4), FLOATS),
    C("aten.lgamma.default", lambda d: A(pos(d, 3, 4) + 1), (F32,), "zeros_1_2"),
    C("aten.lgamma.default", lambda d: A(-pos(d, 3, 4) * 3), (F32,), "negative"),
    C("aten.lgamma.default", lambda d: A(vals(d, *_GAMMA_EDGES)), (F32,), "poles"),
    C("aten.digamma.default", lambda d: A(t(d, 3, 4) * 4), FLOATS),
    C("aten.digamma.default", lambda d: A(pos(d, 3, 4) * 20), (F32,), "large"),
    C("aten.digamma.default", lambda d: A(vals(d, *_GAMMA_EDGES)), (F32,), "poles"),
    C("aten.exp2.default", lambda d: A(t(d, 3, 4) * 10), FLOATS),
    C("aten.exp2.default", lambda d: A(torch.arange(-24, 24).to(d)), (F32,), "integers"),
    C(
        "aten.exp2.default",
        lambda d: A(vals(d, 127.5, 128, -126, -_INF, _INF, _NAN)),
        (F32,),
        "edge",
    ),
    C("aten.hypot.default", lambda d: A(t(d, 3, 4), t(d, 4)), FLOATS),
    C(
        "aten.hypot.default",
        lambda d: A(vals(d, 3e38, _INF, _NAN, 0), vals(d, 3e38, _NAN, 1, -0.0)),
        (F32,),
        "edge",
    ),
    C("aten.copysign.Tensor", lambda d: A(t(d, 3, 4), t(d, 4)), FLOATS),
    C(
        "aten.copysign.Tensor",
        lambda d: A(t(d, 5), vals(d, 0, -0.0, _INF, -_INF, -1)),
        (F32,),
        "zeros",
    ),
    # remainder takes the divisor's sign (Python's %), fmod the dividend's (C's fmod)
    C("aten.remainder.Tensor", lambda d: A(t(d, 3, 4) * 5, nonzero(d, 3, 4)), (F32, BF16, I64)),
    C("aten.remainder.Tensor", lambda d: A(t(d, 3, 4) * 5, nonzero(d, 4)), (F32, I64), "broadcast"),
    C(
        "aten.remainder.Tensor",
        lambda d: A(
            vals(d, -4, 4, 5.3, -5.3, 1e7 + 3, -1e-8, 3, -3),
            vals(d, 2, -2, 0.1, 0.1, 0.1, 1, _INF, _INF),
        ),
        (F32,),
        "edge",
    ),
    C("aten.remainder.Scalar", lambda d: A(t(d, 3, 4) * 5, -1.5), FLOATS),
    C("aten.remainder.Scalar", lambda d: A(t(d, 3, 4) * 3, 4), (I64,), "int"),
    C("aten.remainder.Scalar", lambda d: A(t(d, 3, 4) * 3, -4), (I64,), "negative"),
    C("aten.remainder.Scalar", lambda d: A(t(I64, 3, 4), 2.5), (F32,), "int_float"),
    C("aten.fmod.Tensor", lambda d: A(t(d, 3, 4) * 5, nonzero(d, 3, 4)), (F32, BF16, I64)),
    C("aten.fmod.Tensor", lambda d: A(t(d, 3, 4) * 5, nonzero(d, 4)), (F32, I64), "broadcast"),
    C("aten.fmod.Scalar", lambda d: A(t(d, 3, 4) * 5, -1.5), FLOATS),
    C("aten.fmod.Scalar", lambda d: A(t(d, 3, 4) * 3, -4), (I64,), "int"),
    C("aten.fmod.Scalar", lambda d: A(t(I64, 3, 4), 2.5), (F32,), "int_float"),
    C("aten.elu.default", lambda d: A(t(d, 3, 4) * 3), FLOATS),
    C("aten.elu.default", lambda d: A(t(d, 3, 4) * 3, 1.5, 2.0, 0.5), FLOATS, "scaled"),
    C("aten.elu.default", lambda d: A(near0(d, 3, 4)), (F32,), "near0"),
    C("aten.elu.default", lambda d: A(specials(d, 3, 4)), (F32,), "special"),
    C("aten.leaky_relu.default", lambda d: A(t(d, 3, 4)), FLOATS),
    C("aten.leaky_relu.default", lambda d: A(t(d, 3, 4), 0.2), FLOATS, "slope"),
    C("aten.leaky_relu.default", lambda d: A(specials(d, 3, 4)), (F32,), "special"),
    C("aten.hardtanh.default", lambda d: A(t(d, 3, 4) * 2), FLOATS),
    C("aten.hardtanh.default", lambda d: A(t(d, 3, 4), -0.5, 0.3), FLOATS, "bounds"),
    C("aten.hardtanh.default", lambda d: A(t(d, 3, 4), -2, 3), (I64,), "int"),
    C("aten.hardtanh.default", lambda d: A(specials(d, 3, 4), 0, 6), (F32,), "relu6_special"),
    C(
        "aten.clamp.Tensor",
        lambda d: A(t(d, 3, 4), small(d, 3, 4) - 1, small(d, 4) + 1),
        (F32, BF16, I64),
    ),
    C("aten.clamp.Tensor", lambda d: A(t(d, 3, 4), t(d, 4)), (F32, I64), "min_only"),
    C("aten.clamp.Tensor", lambda d: A(t(d, 3, 4), None, t(d, 3, 1)), (F32,), "max_only"),
    C(
        "aten.clamp.Tensor",
        lambda d: A(t(d, 4), t(d, 3, 4) + 1, t(d, 3, 4) - 1),
        (F32,),
        "min_above_max",
    ),
    C(
        "aten.clamp.Tensor",
        lambda d: A(t(d, 3), vals(d, _NAN, 0, 0), vals(d, 1, _NAN, 1)),
        (F32,),
        "nan_bounds",
    ),
    C("aten.bitwise_xor.Tensor", lambda d: A(t(d, 3, 4), t(d, 4)), (BOOL, I64)),
    *(
        C(name, lambda d: A(vals(d, -7, 5, -1, 2**40, 3, 9), vals(d, 1, 0, 70, 23, -1, 64)), (I64,))
        for name in ("aten.bitwise_left_shift.Tensor", "aten.bitwise_right_shift.Tensor")
    ),
    *(
        C(
            name,
            lambda d: A(vals(d, 12, -18, 0, 0, 7, -(2**40)), vals(d, 8, 12, 0, 5, -21, 6)),
            (I64,),
        )
        for name in ("aten.gcd.default", "aten.lcm.default")
    ),
    C("aten.logical_xor.default", lambda d: A(small(d, 3, 4), small(d, 4)), (BOOL, F32, I64)),
    C("aten.logical_xor.default", lambda d: A(specials(d, 3, 4), small(d, 3, 4)), (F32,), "nan"),
    C("aten.flip.default", lambda d: A(t(d, 2, 3, 4), [0, -1]), (F32, BF16, I64)),
    C("aten.flip.default", lambda d: A(t(d, 3, 4), [1]), (F32,), "one"),
    C("aten.flip.default", lambda d: A(t(d, 3, 4), []), (F32,), "none"),
]
