"""ONNX rules for the ATen ops of elementwise math (rounding, inverse trigonometry, special
functions, remainders) whose torch.onnx rules are missing or wrong (each entry says why); the
others are translated by torch.onnx's own library.

Each rule computes what the op's CPU kernel computes: 16-bit floats in float32, rounded once at
the end (torch's opmath); float64 stays (ONNX Runtime has no float64 Erf or Atan, so float64
erfinv and atan2 are refused at run time, as torchlib's float64 asin or leaky_relu are). ONNX has
no lgamma, digamma, erfinv, log1p or expm1: they are built here from Exp, Log, Sin, Cos and Erf,
with the reductions that keep float32 to a few ulps (lgamma, digamma and erfinv as the xla rules
build them: backends/xla/rules/math.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from onnxscript import ir, opset23
from onnxscript.function_libs.torch_lib.ops import core as torchlib

__all__ = ["TRANSLATIONS"]

# the ONNX ops, untyped: onnxscript types each op's inputs with type variables over every ONNX
# type, which the values a rule traces (typed when the exporter runs it) cannot be checked against
op: Any = opset23

_ATEN = torch.ops.aten
_HALF = (ir.DataType.BFLOAT16, ir.DataType.FLOAT16)


def _dtype(x) -> ir.DataType:
    return x.dtype if x.dtype is not None else ir.DataType.FLOAT


def _c(value: float, dtype: ir.DataType):
    """A 0-d constant of `dtype` (the exporter knows the dtypes of the rule's inputs, not of the
    values a rule makes, so each rule passes its compute dtype along)."""
    return op.Constant(value=ir.tensor(value, dtype=dtype))


def _rank(dtype: ir.DataType) -> float:
    """Order of torch's promotion: floats above integers, wider above narrower."""
    return dtype.itemsize + (16 if dtype.is_floating_point() else 0)


def _promote(*xs):
    """The operands in the dtype torch computes in (float32 for 16-bit floats; mixed float
    operands in torch's promoted dtype), that dtype, and the result dtype to cast back to."""
    dtypes = {_dtype(x) for x in xs}
    result = max(dtypes, key=_rank)
    if len(dtypes) > 1 and result in _HALF:
        result = ir.DataType.FLOAT  # bfloat16 with float16 promotes to float32
    compute = ir.DataType.FLOAT if result in _HALF else result
    cast = [x if _dtype(x) == compute else op.Cast(x, to=compute) for x in xs]
    return cast, compute, result


def _back(y, compute: ir.DataType, result: ir.DataType):
    return y if compute == result else op.Cast(y, to=result)


def _unary(fn: Callable) -> Callable:
    def rule(x):
        (x,), dt, result = _promote(x)
        return _back(fn(x, dt), dt, result)

    return rule


def _binary(fn: Callable) -> Callable:
    def rule(x, y):
        (x, y), dt, result = _promote(x, y)
        return _back(fn(x, y, dt), dt, result)

    return rule


def _polevl(x, coefficients, dt):
    """Horner's rule, highest power first."""
    y = _c(coefficients[0], dt)
    for c in coefficients[1:]:
        y = op.Add(op.Mul(y, x), _c(c, dt))
    return y


def _log1p(t, dt):
    # log(1 + t) = log(u) * t / (u - 1), u = 1 + t rounded: the quotient cancels u's rounding
    u = op.Add(_c(1, dt), t)
    return op.Where(op.Equal(u, _c(1, dt)), t, op.Div(op.Mul(op.Log(u), t), op.Sub(u, _c(1, dt))))


def _expm1(t, dt):
    # exp(t) - 1 = (e - 1) * t / log(e), e = exp(t) rounded (Kahan); t where e rounds to 1
    e = op.Exp(t)
    m = op.Sub(e, _c(1, dt))
    kahan = op.Div(op.Mul(m, t), op.Log(e))
    saturated = op.Or(op.Equal(m, _c(-1, dt)), op.IsInf(m))
    return op.Where(op.Equal(m, _c(0, dt)), t, op.Where(saturated, m, kahan))


def _signbit(x, dt):
    # x < 0, or -0.0 (1 / -0.0 = -inf); a NaN counts as positive (ONNX cannot read its sign bit)
    zero = _c(0, dt)
    negative_zero = op.And(op.Equal(x, zero), op.Less(op.Div(_c(1, dt), x), zero))
    return op.Or(op.Less(x, zero), negative_zero)


# --------------------------------------------------------------------------- atan2, hypot, copysign


def _atan2(y, x, dt):
    """torchlib's rule is atan(y / x) plus quadrant fixes that turn NaN into 0 and give -pi for
    atan2(+0, x < 0). IEEE atan2: the quadrant from the sign bits; where both operands are zero
    or both infinite, atan2 of their signs (+-0 / +-1, +-1 / +-1)."""
    one = _c(1, dt)
    neg_x, neg_y = _signbit(x, dt), _signbit(y, dt)
    both_zero = op.And(op.Equal(x, _c(0, dt)), op.Equal(y, _c(0, dt)))
    both_inf = op.And(op.IsInf(x), op.IsInf(y))
    unit_x = op.Where(neg_x, op.Neg(one), one)
    x = op.Where(op.Or(both_zero, both_inf), unit_x, x)
    y = op.Where(both_inf, op.Where(neg_y, op.Neg(one), one), y)
    angle = op.Atan(op.Div(y, x))
    pi = _c(math.pi, dt)
    return op.Where(neg_x, op.Where(neg_y, op.Sub(angle, pi), op.Add(angle, pi)), angle)


def _hypot(x, y, dt):
    """No torchlib rule. max * sqrt(1 + (min / max)^2): no overflow; inf wins over NaN."""
    a, b = op.Abs(x), op.Abs(y)
    big, small = op.Max(a, b), op.Min(a, b)
    ratio = op.Div(small, op.Where(op.Equal(big, _c(0, dt)), _c(1, dt), big))
    y = op.Mul(big, op.Sqrt(op.Add(_c(1, dt), op.Mul(ratio, ratio))))
    y = op.Where(op.Or(op.IsNaN(a), op.IsNaN(b)), _c(math.nan, dt), y)
    return op.Where(op.Or(op.IsInf(a), op.IsInf(b)), _c(math.inf, dt), y)


def _copysign(x, y, dt):
    """No torchlib rule (torch.onnx's decomposition needs prims.signbit)."""
    magnitude = op.Abs(x)
    return op.Where(_signbit(y, dt), op.Neg(magnitude), magnitude)


# --------------------------------------------------------------------------- remainder


def _remainder(x, y, dt):
    # torchlib computes x - y * floor(x / y): 0 instead of 0.1 for remainder(5.3, 0.1), NaN for a
    # divisor of inf. torch: fmod(x, y), plus y where that is nonzero and its sign differs from y's
    if dt.is_integer():
        return op.Mod(x, y)  # fmod=0: the divisor's sign, as Python's %
    m = op.Mod(x, y, fmod=1)
    zero = _c(0, dt)
    differs = op.Xor(op.Less(m, zero), op.Less(y, zero))
    return op.Where(op.And(op.Not(op.Equal(m, zero)), differs), op.Add(m, y), m)


def _with_scalar(fn: Callable) -> Callable:
    """A rule of (tensor, Python scalar) in torch's result dtype: an integer tensor with a float
    scalar computes in float32."""

    def rule(x, other):
        (x,), dt, result = _promote(x)
        if dt.is_integer() and isinstance(other, float):
            dt = result = ir.DataType.FLOAT
            x = op.Cast(x, to=dt)
        return _back(fn(x, _c(other, dt), dt), dt, result)

    return rule


# --------------------------------------------------------------------------- elu


def elu(x, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0):
    """torchlib scales positive inputs by input_scale * scale (torch: scale alone), computes
    exp(x) - 1 (no expm1: 20% off near 0) and rounds 16-bit results twice. torch:
    x >= 0 ? x * scale : expm1(x * input_scale) * (alpha * scale)."""
    (x,), dt, result = _promote(x)
    negcoef = op.Mul(_c(alpha, dt), _c(scale, dt))
    negative = op.Mul(_expm1(op.Mul(x, _c(input_scale, dt)), dt), negcoef)
    y = op.Where(op.GreaterOrEqual(x, _c(0, dt)), op.Mul(x, _c(scale, dt)), negative)
    return _back(y, dt, result)


# --------------------------------------------------------------------------- erfc, erfinv

# erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z / 2), z >= 0 (Numerical Recipes' erfcc, relative
# error 1.2e-7); highest power first
_ERFC_P = (
    0.17087277,
    -0.82215223,
    1.48851587,
    -1.13520398,
    0.27886807,
    -0.18628806,
    0.09678418,
    0.37409196,
    1.00002368,
    -1.26551223,
)


def _erfc(x, dt):
    """torchlib's rule is 1 - erf(x): no significant digits left from x = 4 on. Here z^2 is
    split as hi^2 + lo (z + hi), hi = z to 1/16 (hi^2 exact), so exp(-z^2) keeps float32."""
    z = op.Abs(x)
    t = op.Div(_c(1, dt), op.Add(_c(1, dt), op.Mul(_c(0.5, dt), z)))
    hi = op.Div(op.Floor(op.Mul(z, _c(16, dt))), _c(16, dt))
    lo = op.Sub(z, hi)
    rest = op.Sub(_polevl(t, _ERFC_P, dt), op.Mul(lo, op.Add(z, hi)))
    y = op.Mul(op.Mul(t, op.Exp(op.Neg(op.Mul(hi, hi)))), op.Exp(rest))
    y = op.Where(op.IsInf(z), _c(0, dt), y)
    return op.Where(op.Less(x, _c(0, dt)), op.Sub(_c(2, dt), y), y)


# torch's calc_erfinv (ATen/native/Math.h): a rational first guess, then two Newton steps
_ERFINV_A = (-0.140543331, 0.914624893, -1.645349621, 0.886226899)
_ERFINV_B = (0.012229801, -0.329097515, 1.442710462, -2.118377725, 1.0)
_ERFINV_C = (1.641345311, 3.429567803, -1.624906493, -1.970840454)
_ERFINV_D = (1.637067800, 3.543889200, 1.0)


def _erfinv(y, dt):
    """No torchlib rule."""
    ay = op.Abs(y)
    one = _c(1, dt)
    z = op.Mul(y, y)
    central = op.Div(op.Mul(y, _polevl(z, _ERFINV_A, dt)), _polevl(z, _ERFINV_B, dt))
    w = op.Sqrt(op.Neg(op.Log(op.Div(op.Sub(one, ay), _c(2, dt)))))
    tail = op.Div(_copysign(_polevl(w, _ERFINV_C, dt), y, dt), _polevl(w, _ERFINV_D, dt))
    in_center = op.LessOrEqual(ay, _c(0.7, dt))
    x = op.Where(in_center, central, tail)
    slope = _c(2 / math.sqrt(math.pi), dt)
    for _ in range(2):
        # the residual erf(x) - y; in the tail (1 - |y|) - erfc(|x|), where erf(x) rounds near 1
        tail_residual = op.Mul(op.Sign(y), op.Sub(op.Sub(one, ay), _erfc(op.Abs(x), dt)))
        residual = op.Where(in_center, op.Sub(op.Erf(x), y), tail_residual)
        x = op.Sub(x, op.Div(residual, op.Mul(slope, op.Exp(op.Neg(op.Mul(x, x))))))
    x = op.Where(op.Equal(ay, one), _copysign(_c(math.inf, dt), y, dt), x)
    return op.Where(op.Greater(ay, one), _c(math.nan, dt), x)


# --------------------------------------------------------------------------- lgamma, digamma

# lgamma(2 + t) = t * Q(t) on [-0.5, 0.5] (the xla rules' table; relative error 5e-10)
_LGAMMA_Q = (
    0.00011347281994554691,
    -0.0002538170956727826,
    0.0005065171429518161,
    -0.0011858600344983208,
    0.002890795321559696,
    -0.007386174155633413,
    0.020580799471518252,
    -0.0673522814721006,
    0.3224670334689425,
    0.4227843350004583,
)
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _lgamma_positive(x, dt):
    """lgamma(x), x >= 0: Stirling's series from 13; below, lgamma(x) = lgamma(x - 1) + log(x - 1)
    down into [0, 2.5), where lgamma(2 + t) = t Q(t), t = x - 2, x - 1 or x (exact)."""
    big = op.GreaterOrEqual(x, _c(13, dt))
    s = op.Where(big, x, _c(13, dt))
    inv = op.Div(_c(1, dt), s)
    inv2 = op.Mul(inv, inv)
    inner = op.Sub(_c(1 / 360, dt), op.Div(inv2, _c(1260, dt)))
    series = op.Mul(inv, op.Sub(_c(1 / 12, dt), op.Mul(inv2, inner)))
    head = op.Mul(op.Sub(s, _c(0.5, dt)), op.Sub(op.Log(s), _c(1, dt)))
    stirling = op.Add(op.Add(head, _c(_HALF_LOG_2PI - 0.5, dt)), series)
    u = op.Where(big, _c(2, dt), x)
    product = _c(1, dt)
    for _ in range(11):  # 13 - 11 = 2 < 2.5
        down = op.GreaterOrEqual(u, _c(2.5, dt))
        u = op.Where(down, op.Sub(u, _c(1, dt)), u)
        product = op.Where(down, op.Mul(product, u), product)
    from_1 = op.GreaterOrEqual(u, _c(0.5, dt))
    from_2 = op.GreaterOrEqual(u, _c(1.5, dt))
    t = op.Where(from_2, op.Sub(u, _c(2, dt)), op.Where(from_1, op.Sub(u, _c(1, dt)), u))
    below = op.Where(from_1, _log1p(t, dt), op.Add(op.Log(u), _log1p(u, dt)))
    small = op.Sub(op.Mul(t, _polevl(t, _LGAMMA_Q, dt)), op.Where(from_2, _c(0, dt), below))
    return op.Where(big, stirling, op.Add(small, op.Log(product)))


def _lgamma(x, dt):
    """No torchlib rule. x < 0: log(pi / |x sin(pi x)|) - lgamma(-x), sin(pi x) from the exact
    x - round(x)."""
    a = op.Abs(x)
    positive = _lgamma_positive(a, dt)
    sine = op.Abs(op.Sin(op.Mul(_c(math.pi, dt), op.Sub(x, op.Round(x)))))
    logs = op.Add(op.Log(a), op.Log(sine))
    reflected = op.Sub(op.Sub(_c(math.log(math.pi), dt), logs), positive)
    y = op.Where(op.Less(x, _c(0, dt)), reflected, positive)
    return op.Where(op.IsInf(x), _c(math.inf, dt), y)


# torch's calc_digamma: psi(x) = psi(1 - x) - pi / tan(pi x) below 0, psi(x) = psi(x + 1) - 1 / x
# up to x >= 10, then the asymptotic series
_PSI_10 = 2.25175258906672110764
_DIGAMMA_A = (
    8.33333333333333333333e-2,
    -2.10927960927960927961e-2,
    7.57575757575757575758e-3,
    -4.16666666666666666667e-3,
    3.96825396825396825397e-3,
    -8.33333333333333333333e-3,
    8.33333333333333333333e-2,
)


def _digamma(x, dt):
    """No torchlib rule."""
    one, ten = _c(1, dt), _c(10, dt)
    negative = op.Less(x, _c(0, dt))
    z = op.Where(negative, op.Sub(one, x), x)
    acc = _c(0, dt)
    for _ in range(10):  # z > 0 reaches 10 in at most 10 steps
        push = op.Less(z, ten)
        acc = op.Where(push, op.Sub(acc, op.Div(one, z)), acc)
        z = op.Where(push, op.Add(z, one), z)
    zz = op.Div(one, op.Mul(z, z))
    series = op.Where(op.Less(z, _c(1e17, dt)), op.Mul(zz, _polevl(zz, _DIGAMMA_A, dt)), _c(0, dt))
    asymptotic = op.Sub(op.Sub(op.Add(acc, op.Log(z)), op.Div(_c(0.5, dt), z)), series)
    psi = op.Where(op.Equal(z, ten), op.Add(acc, _c(_PSI_10, dt)), asymptotic)
    # pi / tan(pi x) = pi cos(pi r) / sin(pi r), r = x - round(x) exact: pi r rounds relative to
    # r (Sin and Cos, not Tan: ONNX Runtime has no float64 Tan)
    angle = op.Mul(_c(math.pi, dt), op.Sub(x, op.Round(x)))
    reflect = op.Div(op.Mul(_c(math.pi, dt), op.Cos(angle)), op.Sin(angle))
    psi = op.Where(negative, op.Sub(psi, reflect), psi)
    pole = op.And(negative, op.Equal(x, op.Floor(x)))
    psi = op.Where(pole, _c(math.nan, dt), psi)
    signed_inf = _copysign(_c(math.inf, dt), op.Neg(x), dt)
    return op.Where(op.Equal(x, _c(0, dt)), signed_inf, psi)


# --------------------------------------------------------------------------- integer pow


def _integer_pow(base, exponent, dt):
    """torch's integer pow, wrapping as its kernel does: binary exponentiation over every bit
    of the exponent (ONNX Runtime's integer Pow goes through double: inexact past 2^53, and
    INT64_MIN on overflow); a negative exponent gives 1 for base 1, +-1 for base -1 by parity
    and 0 otherwise."""
    zero, one, two = _c(0, dt), _c(1, dt), _c(2, dt)
    negative = op.Less(exponent, zero)
    remaining = op.Where(negative, zero, exponent)
    power = op.Add(op.Mul(op.Add(base, exponent), zero), one)  # ones, broadcast
    square = base
    for _ in range(int(8 * dt.itemsize) - 1):
        odd = op.Equal(op.Mod(remaining, two), one)
        power = op.Where(odd, op.Mul(power, square), power)
        square = op.Mul(square, square)
        remaining = op.Div(remaining, two)
    parity = op.Where(op.Equal(op.Mod(exponent, two), zero), one, op.Neg(one))
    inverse = op.Where(
        op.Equal(base, one), one, op.Where(op.Equal(base, op.Neg(one)), parity, zero)
    )
    return op.Where(negative, op.Add(op.Mul(power, zero), inverse), power)


def _integer_pow_by(base, exponent: int, dt):
    """base ** exponent for a Python int exponent >= 0: the squarings it needs, no more."""
    power = None
    square = base
    while exponent:
        if exponent & 1:
            power = square if power is None else op.Mul(power, square)
        exponent >>= 1
        if exponent:
            square = op.Mul(square, square)
    return op.Add(op.Mul(base, _c(0, dt)), _c(1, dt)) if power is None else power


def pow_tensor_tensor(x, exponent):
    if _dtype(x).is_integer() and _dtype(exponent).is_integer():
        (x, exponent), dt, _ = _promote(x, exponent)
        return _integer_pow(x, exponent, dt)
    return torchlib.aten_pow(x, exponent)


def pow_tensor_scalar(x, exponent):
    if _dtype(x).is_integer() and isinstance(exponent, int) and not isinstance(exponent, bool):
        if exponent >= 0:  # eager refuses a negative one
            return _integer_pow_by(x, exponent, _dtype(x))
    return torchlib.aten_pow_tensor_scalar(x, exponent)


def pow_scalar(base, exponent):
    if isinstance(base, int) and not isinstance(base, bool) and _dtype(exponent).is_integer():
        dt = _dtype(exponent)
        return _integer_pow(_c(base, dt), exponent, dt)
    return torchlib.aten_pow_scalar(base, exponent)


def _rounding(name: str) -> Callable:
    """floor / ceil / trunc / round: the identity on integers (ONNX's Floor & co. take floats
    only: the checker refused the model), torchlib's rule on floats."""

    def rule(x):
        if not _dtype(x).is_floating_point():
            return op.Identity(x)
        return getattr(torchlib, f"aten_{name}")(x)

    return rule


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _ATEN.pow.Tensor_Tensor: pow_tensor_tensor,
    _ATEN.pow.Tensor_Scalar: pow_tensor_scalar,
    _ATEN.pow.Scalar: pow_scalar,
    **{getattr(_ATEN, n).default: _rounding(n) for n in ("floor", "ceil", "trunc", "round")},
    _ATEN.atan2.default: _binary(_atan2),
    _ATEN.hypot.default: _binary(_hypot),
    _ATEN.copysign.Tensor: _binary(_copysign),
    _ATEN.remainder.Tensor: _binary(_remainder),
    _ATEN.remainder.Scalar: _with_scalar(_remainder),
    _ATEN.elu.default: elu,
    _ATEN.erfc.default: _unary(_erfc),
    _ATEN.erfinv.default: _unary(_erfinv),
    _ATEN.lgamma.default: _unary(_lgamma),
    _ATEN.digamma.default: _unary(_digamma),
}
