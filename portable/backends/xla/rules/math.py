"""Elementwise math beyond arithmetic: rounding, logarithms and exponentials near 0, inverse
trigonometric and hyperbolic functions, special functions, remainders, and the activations whose
backward ops the opset holds (elu, leaky_relu, hardtanh).

Where XLA's own function is further from torch's CPU kernel than float32 rounding (lgamma near its
zeros, erfinv near +-1, digamma near its poles, exp2 at integers, sinh / cosh near overflow), the
rule computes torch's algorithm, or an accurate float32 form, from exp, log, erf and tan; the onnx
translations (backends/onnx/translations/math.py) build the same forms.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import RULES
from ._util import as_array, opmath, opmath_binary, opmath_unary, out_dtype, scalar_like
from .elementwise import clamp

for _name, _fn in {
    "aten.log1p.default": jnp.log1p,
    "aten.expm1.default": jnp.expm1,
    "aten.log2.default": jnp.log2,
    "aten.log10.default": jnp.log10,
}.items():
    RULES.register(_name)(opmath_unary(_fn))


@RULES.register("aten.sign.default")
def sign(ctx, x):
    # torch's kernel is (0 < x) - (x < 0): NaN gives 0, and -0.0 gives 0
    dtype = out_dtype(ctx)
    x = as_array(x, dtype)
    zero = jnp.zeros((), dtype)
    return (x > zero).astype(dtype) - (x < zero).astype(dtype)


def _rounding(fn):
    """floor/ceil/trunc/round: exact in any float dtype; the identity on integers."""

    def rule(ctx, x):
        dtype = out_dtype(ctx)
        x = as_array(x, dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            return x
        return fn(x)

    return rule


for _name, _fn in {
    "aten.floor.default": jnp.floor,
    "aten.ceil.default": jnp.ceil,
    "aten.trunc.default": jnp.trunc,
    "aten.round.default": jnp.round,  # round half to even, as torch (nearbyint)
}.items():
    RULES.register(_name)(_rounding(_fn))


@RULES.register("aten.round.decimals")
def round_decimals(ctx, x, *, decimals=0):
    # ATen: nearbyint(x * 10^d) / 10^d, or nearbyint(x / 10^-d) * 10^-d for d < 0; bfloat16
    # computes in float32 and rounds once (an intermediate bfloat16 rounding moves ties)
    dtype = out_dtype(ctx)
    x = as_array(x, dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return x
    if decimals == 0:
        return jnp.round(x)
    compute = opmath(dtype)
    a, p = x.astype(compute), jnp.asarray(10.0 ** abs(decimals), compute)
    y = jnp.round(a / p) * p if decimals < 0 else jnp.round(a * p) / p
    return y.astype(dtype)


@RULES.register("aten.isinf.default")
def isinf(ctx, x):
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, jnp.bool_)
    return jnp.isinf(x)


# --------------------------------------------------------------------------- trigonometric kin

for _name, _fn in {
    "aten.asin.default": jnp.arcsin,
    "aten.acos.default": jnp.arccos,
    "aten.atan.default": jnp.arctan,
    "aten.tan.default": jnp.tan,
    "aten.asinh.default": jnp.arcsinh,
    "aten.acosh.default": jnp.arccosh,
    "aten.atanh.default": jnp.arctanh,
    "aten.erfc.default": jax.scipy.special.erfc,
}.items():
    RULES.register(_name)(opmath_unary(_fn))


def _hyperbolic(odd: bool) -> Callable[..., jax.Array]:
    """sinh (odd) or cosh from exp(|x|) as 0.5 e +- 0.5 / e; sinh below 1 from expm1 (no
    cancellation), and above log(max) from exp(|x| / 2)^2 / 2 (e overflows first). XLA's own
    forms are exp(|x| + log 0.5), which rounds the sum: 10 ulps off at |x| = 88."""

    def fn(x):
        a = jnp.abs(x)
        big = a >= math.floor(math.log(float(jnp.finfo(x.dtype).max)))
        e = jnp.exp(jnp.where(big, scalar_like(0, a), a))
        half = jnp.exp(a / 2)
        y = jnp.where(big, (0.5 * half) * half, 0.5 * e + (-0.5 if odd else 0.5) / e)
        if not odd:
            return y
        m = jnp.expm1(a)
        return jnp.copysign(jnp.where(a < 1, 0.5 * (m + m / (m + 1)), y), x)

    return fn


RULES.register("aten.sinh.default")(opmath_unary(_hyperbolic(odd=True)))
RULES.register("aten.cosh.default")(opmath_unary(_hyperbolic(odd=False)))


_BINARY: dict[tuple[str, ...], Callable[..., jax.Array]] = {
    ("aten.atan2.default",): jnp.arctan2,
    ("aten.hypot.default",): jnp.hypot,
    ("aten.copysign.Tensor",): jnp.copysign,
    # jnp.remainder is torch's kernel: fmod(x, y), plus y where it is nonzero and the signs differ
    ("aten.remainder.Tensor", "aten.remainder.Scalar"): jnp.remainder,
    ("aten.fmod.Tensor", "aten.fmod.Scalar"): jnp.fmod,  # C's fmod; truncating on integers
    ("aten.bitwise_xor.Tensor",): jnp.bitwise_xor,
    ("aten.gcd.default",): jnp.gcd,  # >= 0, gcd(0, 0) = 0, as torch's calc_gcd
}
for _names, _binary_fn in _BINARY.items():
    RULES.register(*_names)(opmath_binary(_binary_fn))

RULES.register("aten.clamp.Tensor")(clamp)  # scalar and tensor bounds lower alike


def _shift_operands(ctx, x, y):
    dtype = out_dtype(ctx)
    x, y = as_array(x, dtype), as_array(y, dtype)
    # torch's kernels compare the shift as unsigned: a negative one is past the width too
    past = (y < 0) | (y >= jnp.iinfo(dtype).bits)
    return x, jnp.where(past, 0, y), past


@RULES.register("aten.bitwise_left_shift.Tensor")
def bitwise_left_shift(ctx, x, y):
    x, y, past = _shift_operands(ctx, x, y)
    return jnp.where(past, 0, jnp.left_shift(x, y)).astype(x.dtype)


@RULES.register("aten.bitwise_right_shift.Tensor")
def bitwise_right_shift(ctx, x, y):
    x, y, past = _shift_operands(ctx, x, y)
    sign = jnp.where(x < 0, -jnp.ones_like(x), jnp.zeros_like(x))
    return jnp.where(past, sign, jnp.right_shift(x, y)).astype(x.dtype)  # arithmetic: signed


@RULES.register("aten.lcm.default")
def lcm(ctx, x, y):
    # torch: g = gcd(x, y); g == 0 ? 0 : |x / g * y| (the division exact, then the product)
    dtype = out_dtype(ctx)
    x, y = as_array(x, dtype), as_array(y, dtype)
    g = jnp.gcd(x, y)
    safe = jnp.where(g == 0, jnp.ones_like(g), g)
    return jnp.where(g == 0, jnp.zeros_like(g), jnp.abs(jax.lax.div(x, safe) * y))


@RULES.register("aten.logical_xor.default")
def logical_xor(ctx, x, y):
    return jnp.logical_xor(x, y)


# --------------------------------------------------------------------------- exp2


def _scale2(y, n):
    """y * 2^n for integral float `n` in [-2 * bias + 2, 2 * bias], exactly (as two factors whose
    exponent fields are written directly), unless the result is subnormal."""
    info = jnp.finfo(y.dtype)
    bits = jnp.dtype(f"int{info.bits}")
    bias = info.maxexp - 1

    def power(k):
        return jax.lax.bitcast_convert_type((k.astype(bits) + bias) << info.nmant, y.dtype)

    half = jnp.floor(n / 2)
    return y * power(half) * power(n - half)


@RULES.register("aten.exp2.default")
def exp2(ctx, x):
    # 2^x = 2^f * 2^n, n = round(x), f = x - n exact in [-0.5, 0.5]: exact at integers, as torch's
    # kernel (XLA's exp2 is exp(x * ln 2), which rounds x * ln 2: 2^-17 comes out 5e-7 off)
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    x = as_array(x, compute)
    bound = scalar_like(2 * (jnp.finfo(compute).maxexp - 2), x)
    x = jnp.clip(x, -bound, bound)
    n = jnp.round(x)
    return _scale2(jnp.exp2(x - n), n).astype(dtype)


# --------------------------------------------------------------------------- special functions


def _polevl(x, coefficients):
    """Horner's rule, highest power first (Cephes' polevl)."""
    y = jnp.zeros_like(x)
    for c in coefficients:
        y = y * x + c
    return y


# torch's calc_erfinv (ATen/native/Math.h): a rational first guess, then two Newton steps
_ERFINV_A = (-0.140543331, 0.914624893, -1.645349621, 0.886226899)
_ERFINV_B = (0.012229801, -0.329097515, 1.442710462, -2.118377725, 1.0)
_ERFINV_C = (1.641345311, 3.429567803, -1.624906493, -1.970840454)
_ERFINV_D = (1.637067800, 3.543889200, 1.0)


@RULES.register("aten.erfinv.default")
def erfinv(ctx, y):
    dtype = out_dtype(ctx)
    y = as_array(y, opmath(dtype))
    ay = jnp.abs(y)
    z = y * y
    central = y * _polevl(z, _ERFINV_A) / _polevl(z, _ERFINV_B)
    w = jnp.sqrt(-jnp.log((1 - ay) / 2))
    tail = jnp.copysign(_polevl(w, _ERFINV_C), y) / _polevl(w, _ERFINV_D)
    x = jnp.where(ay <= 0.7, central, tail)
    slope = jnp.asarray(2, y.dtype) * jnp.asarray(1 / math.sqrt(math.pi), y.dtype)
    for _ in range(2):
        # the residual erf(x) - y; in the tail as (1 - |y|) - erfc(|x|), both exact or accurate
        # where erf(x) rounds near 1 (XLA's erf there is off by ulps that Newton magnifies 1e3x)
        tail_residual = jnp.sign(y) * ((1 - ay) - jax.scipy.special.erfc(jnp.abs(x)))
        residual = jnp.where(ay <= 0.7, jax.scipy.special.erf(x) - y, tail_residual)
        x = x - residual / (slope * jnp.exp(-x * x))
    x = jnp.where(ay == 1, jnp.copysign(scalar_like(jnp.inf, y), y), x)
    return jnp.where(ay > 1, scalar_like(jnp.nan, y), x).astype(dtype)


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


@RULES.register("aten.digamma.default")
def digamma(ctx, x):
    dtype = out_dtype(ctx)
    x = as_array(x, opmath(dtype))
    negative = x < 0
    z = jnp.where(negative, 1 - x, x)
    acc = jnp.zeros_like(x)
    for _ in range(10):  # z > 0 reaches 10 in at most 10 steps
        push = z < 10
        acc = jnp.where(push, acc - 1 / z, acc)
        z = jnp.where(push, z + 1, z)
    zz = 1 / (z * z)
    series = jnp.where(z < 1e17, zz * _polevl(zz, _DIGAMMA_A), scalar_like(0, x))
    psi = jnp.where(z == 10, acc + _PSI_10, acc + jnp.log(z) - 0.5 / z - series)
    # tan(pi x) = tan(pi r), r = x - round(x) exact in [-0.5, 0.5]: pi r rounds relative to r, so
    # near the poles this is as good as torch's double-precision tan
    r = x - jnp.round(x)
    psi = jnp.where(negative, psi - jnp.pi / jnp.tan(jnp.pi * r), psi)
    psi = jnp.where(negative & (x == jnp.trunc(x)), scalar_like(jnp.nan, x), psi)
    return jnp.where(x == 0, jnp.copysign(scalar_like(jnp.inf, x), -x), psi).astype(dtype)


# lgamma(2 + t) = t * Q(t) on [-0.5, 0.5]: Q interpolated at 10 Chebyshev nodes (mpmath, 40
# digits), relative error 5e-10; highest power first
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


def _lgamma_positive(x):
    """lgamma(x) for x >= 0 in float32 to a few ulps. Stirling's series from 13; below, the
    recurrence lgamma(x) = lgamma(x - 1) + log(x - 1) moves x into [0, 2.5), where
    lgamma(2 + t) = t Q(t) with t = x - 2, x - 1 or x (exact) and log terms for the rest."""
    big = x >= 13
    s = jnp.where(big, x, scalar_like(13, x))
    inv = 1 / s
    inv2 = inv * inv
    series = inv * (1 / 12 - inv2 * (1 / 360 - inv2 / 1260))
    stirling = (s - 0.5) * (jnp.log(s) - 1) + (_HALF_LOG_2PI - 0.5) + series
    u = jnp.where(big, scalar_like(2, x), x)
    product = jnp.ones_like(x)
    for _ in range(11):  # 13 - 11 = 2 < 2.5
        down = u >= 2.5
        u = jnp.where(down, u - 1, u)
        product = jnp.where(down, product * u, product)
    t = jnp.where(u >= 1.5, u - 2, jnp.where(u >= 0.5, u - 1, u))
    # lgamma(u) = lgamma(2 + t) - log(u) (u in [0.5, 1.5)) or - log(u) - log(u + 1) (u < 0.5)
    below = jnp.where(u >= 0.5, jnp.log1p(t), jnp.log(u) + jnp.log1p(u))
    small = t * _polevl(t, _LGAMMA_Q) - jnp.where(u >= 1.5, scalar_like(0, x), below)
    return jnp.where(big, stirling, small + jnp.log(product))


def _lgamma_f32(x):
    a = jnp.abs(x)
    positive = _lgamma_positive(a)
    # x < 0: lgamma(x) = log(pi / |x sin(pi x)|) - lgamma(-x); sin(pi x) = +-sin(pi (x - round x))
    sine = jnp.abs(jnp.sin(jnp.pi * (x - jnp.round(x))))
    reflected = math.log(math.pi) - jnp.log(a) - jnp.log(sine) - positive
    y = jnp.where(x < 0, reflected, positive)
    return jnp.where(jnp.isinf(x), scalar_like(jnp.inf, x), y)


@RULES.register("aten.lgamma.default")
def lgamma(ctx, x):
    # XLA's lgamma (a Lanczos sum) is up to 2e-6 off near 1.5 to 4 and near its negative zeros,
    # where torch (the C library's lgammaf) is within an ulp: float32 uses the form above
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    x = as_array(x, compute)
    y = jax.lax.lgamma(x) if jnp.dtype(compute) == jnp.float64 else _lgamma_f32(x)
    return y.astype(dtype)


# --------------------------------------------------------------------------- activations


@RULES.register("aten.elu.default")
def elu(ctx, x, alpha=1, scale=1, input_scale=1):
    # torch: x >= 0 ? x * scale : expm1(x * input_scale) * (alpha * scale), in opmath
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    x = as_array(x, compute)
    scale_ = as_array(scale, compute)
    negative = jnp.expm1(x * as_array(input_scale, compute)) * (as_array(alpha, compute) * scale_)
    return jnp.where(x >= 0, x * scale_, negative).astype(dtype)


@RULES.register("aten.leaky_relu.default")
def leaky_relu(ctx, x, negative_slope=0.01):
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    x = as_array(x, compute)
    return jnp.where(x > 0, x, x * as_array(negative_slope, compute)).astype(dtype)


@RULES.register("aten.hardtanh.default")
def hardtanh(ctx, x, min_val=-1, max_val=1):
    # torch's hardtanh is clamp: bounds in the tensor's dtype, NaN propagates
    return clamp(ctx, x, min_val, max_val)
