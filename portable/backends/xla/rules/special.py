"""Special functions (opset family `special`): polygamma, orthogonal polynomials, incomplete
gamma, erfcx and the float bit-level helpers; the Bessel and Airy functions are in bessel.py.

Each rule computes in opmath (float32 for bfloat16) and rounds once, as torch's kernels do. XLA's
own functions serve where they agree with torch's CPU kernel to float32 rounding (i0, i0e, i1,
i1e, ndtri, igamma, igammac, nextafter, Hurwitz zeta for q > 0); elsewhere the rule computes
torch's algorithm (Cephes' series and rational forms for the Bessel and Airy functions, the
recurrences of the polynomials, trigamma's asymptotic series) or an accurate float32 form where
torch computes in double (polygamma n >= 2 at x < 0 by reflection; erfcx by its continued
fraction). The Hurwitz zeta itself has no rule: at q < 0 torch sums in double and a float32 sum
cancels (tests/test_xla_rules.py EXCLUDED).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.scipy.special as jss

from . import RULES
from ._util import (
    as_array,
    opmath,
    opmath_binary,
    opmath_unary,
    out_dtype,
    scalar_like,
    unsupported,
)
from .math import _scale2, digamma

for _name, _fn in {
    "aten.i0.default": jss.i0,
    "aten.special_i1.default": jss.i1,
    "aten.special_i1e.default": jax.lax.bessel_i1e,
    "aten.special_ndtri.default": jss.ndtri,
}.items():
    RULES.register(_name)(opmath_unary(_fn))


def _erfcx(x):
    # exp(x^2) erfc(x). |x| >= 1: the continued fraction 1 / (sqrt(pi) (x + (1/2) / (x + 1 / (x +
    # (3/2) / ...)))), 60 terms (converged to float32 rounding from 1 up); below 1, exp(x^2) with
    # x^2 split exactly into p + e (Dekker) times XLA's erfc (whose own exp(-x^2) is off past 3).
    # x < 0 as torch: 2 exp(x * x) - erfcx(-x) (its rounded x * x included), inf below -26.7
    a = jnp.abs(x)
    c = scalar_like(4097.0, a) * a
    hi = c - (c - a)
    lo = a - hi
    p = a * a
    e = ((hi * hi - p) + 2 * hi * lo) + lo * lo
    small = jnp.exp(p) * (1 + e) * jss.erfc(a)
    b = jnp.maximum(a, scalar_like(1, a))
    d = b
    for k in range(60, 0, -1):
        d = b + scalar_like(k / 2, b) / d
    positive = jnp.where(a < 1, small, scalar_like(1 / math.sqrt(math.pi), d) / d)
    negative = jnp.where(x < -26.7, scalar_like(jnp.inf, x), 2 * jnp.exp(x * x) - positive)
    return jnp.where(x < 0, negative, positive)


RULES.register("aten.special_erfcx.default")(opmath_unary(_erfcx))


@RULES.register("aten.special_i0e.default")
def i0e(ctx, x):
    # torch's bfloat16 / float16 i0e is float32 on whole SIMD vectors but half-precision
    # arithmetic (every step rounded) on the tail elements past them: position-dependent
    dtype = out_dtype(ctx)
    if jnp.dtype(dtype) != jnp.dtype(opmath(dtype)):
        raise unsupported(
            ctx,
            f"special_i0e in {jnp.dtype(dtype).name}: torch rounds its tail elements differently",
            "compute i0e in float32 (x.float()) and cast the result",
        )
    return jax.lax.bessel_i0e(as_array(x, dtype))


# --------------------------------------------------------------------------- polygamma, zeta


def _trigamma(x):
    # torch's float trigamma: reflection below 0.5 (pi^2 / sin^2(pi x), x -> 1 - x), six steps of
    # psi1(x) = psi1(x + 1) + 1 / x^2, then the asymptotic series
    reflect = x < 0.5
    s = jnp.sin(scalar_like(math.pi, x) * x)
    result = jnp.where(reflect, -scalar_like(math.pi * math.pi, x) / (s * s), scalar_like(0, x))
    z = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (z * z)
        z = z + 1
    ixx = 1 / (z * z)
    tail = ixx * (
        scalar_like(1 / 6, x) - ixx * (scalar_like(1 / 30, x) - ixx * scalar_like(1 / 42, x))
    )
    result = result + (1 + 1 / (2 * z) + tail) / z
    return jnp.where(reflect, -result, result)


def _cot_derivative(n: int) -> tuple[float, ...]:
    """Coefficients (highest power first) of Q_n with d^n/dx^n cot(pi x) = pi^n Q_n(cot(pi x)):
    Q_0 = c, Q_(k+1) = -(1 + c^2) Q_k'(c) (as d cot(pi x) / dx = -pi (1 + cot^2))."""
    q = [0.0, 1.0]  # ascending powers of c
    for _ in range(n):
        dq = [i * q[i] for i in range(1, len(q))]
        nxt = [0.0] * (len(dq) + 2)
        for i, v in enumerate(dq):
            nxt[i] -= v
            nxt[i + 2] -= v
        q = nxt
    return tuple(reversed(q))


def _polygamma_n(n: int, x: jax.Array) -> jax.Array:
    """torch's (-1)^(n+1) n! zeta(n + 1, x) for n >= 2, computed in float32 without the
    cancellation of the zeta sum at x < 0: there the reflection psi_n(x) = (-1)^n psi_n(1 - x) -
    pi^(n+1) Q_n(cot(pi x)), 1 - x > 1 by XLA's zeta (torch's Cephes form); inf at 0 and the
    negative integers (zeta's pole, times the sign of (-1)^(n+1))."""
    factor = scalar_like((1.0 if n % 2 else -1.0) * math.factorial(n), x)
    s = scalar_like(n + 1, x)
    negative = x < 0
    psi = factor * jax.lax.zeta(s, jnp.where(negative, 1 - x, x))
    # r = x - round(x) is exact and cot(pi x) = cot(pi r); past |r| = 1/4, cot(pi r) =
    # sign(r) tan(pi (1/2 - |r|)) with 1/2 - |r| exact, so pi times it rounds relative to it
    r = x - jnp.round(x)
    half = jnp.abs(r) > 0.25
    pi = scalar_like(math.pi, x)
    cot = jnp.where(half, jnp.sign(r) * jnp.tan(pi * (0.5 - jnp.abs(r))), 1 / jnp.tan(pi * r))
    reflected = (-psi if n % 2 else psi) - scalar_like(math.pi ** (n + 1), x) * _polevl(
        cot, _cot_derivative(n)
    )
    y = jnp.where(negative, reflected, psi)
    pole = (x <= 0) & (x == jnp.floor(x))
    return jnp.where(pole, factor * scalar_like(jnp.inf, x), y)


def _polevl(x, coefficients):
    acc = jnp.zeros_like(x)
    for c in coefficients:
        acc = acc * x + scalar_like(c, x)
    return acc


@RULES.register("aten.polygamma.default")
def polygamma(ctx, n, x):
    # torch: digamma (n = 0), trigamma (n = 1), else (-1)^(n+1) n! zeta(n + 1, x)
    if n == 0:
        return digamma(ctx, x)
    dtype = out_dtype(ctx)
    x = as_array(x, opmath(dtype))
    return (_trigamma(x) if n == 1 else _polygamma_n(n, x)).astype(dtype)


# --------------------------------------------------------------------------- incomplete gamma


def _igamma(upper: bool) -> Callable[..., jax.Array]:
    # torch's domain edges first (a < 0 or x < 0: NaN; a = 0: 1 for x > 0 (P), NaN at x = 0;
    # x = 0: P = 0; a = inf: P = 0, NaN for x = inf; x = inf: P = 1), then XLA's igamma(c)
    def fn(a, x):
        a, x = jnp.broadcast_arrays(a, x)
        nan, one, zero = scalar_like(jnp.nan, a), scalar_like(1, a), scalar_like(0, a)
        y = jax.lax.igammac(a, x) if upper else jax.lax.igamma(a, x)
        p_edge = jnp.where(jnp.isinf(x), one, y)
        p_edge = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, zero), p_edge)
        p_edge = jnp.where(x == 0, zero, p_edge)
        p_edge = jnp.where(a == 0, jnp.where(x > 0, one, nan), p_edge)
        edge = jnp.isinf(x) | jnp.isinf(a) | (x == 0) | (a == 0)
        y = jnp.where(edge, (one - p_edge) if upper else p_edge, y)
        y = jnp.where((a < 0) | (x < 0), nan, y)
        return jnp.where(jnp.isnan(a) | jnp.isnan(x), nan, y)

    return fn


RULES.register("aten.igamma.default", platform="xla")(opmath_binary(_igamma(upper=False)))
RULES.register("aten.igammac.default", platform="xla")(opmath_binary(_igamma(upper=True)))


# --------------------------------------------------------------------------- float bit helpers


@RULES.register("aten.nextafter.default")
def nextafter(ctx, x, y):
    dtype = out_dtype(ctx)
    return jax.lax.nextafter(as_array(x, dtype), as_array(y, dtype))


def _nan_ignoring(pick):
    """fmax / fmin: the other operand where one is NaN (NaN only where both are)."""

    def rule(ctx, x, y):
        dtype = out_dtype(ctx)
        x, y = as_array(x, dtype), as_array(y, dtype)
        z = pick(x, y)
        if not jnp.issubdtype(dtype, jnp.floating):
            return z
        return jnp.where(jnp.isnan(x), y, jnp.where(jnp.isnan(y), x, z))

    return rule


RULES.register("aten.fmax.default")(_nan_ignoring(jnp.maximum))
RULES.register("aten.fmin.default")(_nan_ignoring(jnp.minimum))


@RULES.register("aten.signbit.default")
def signbit(ctx, x):
    if x.dtype == jnp.bool_:
        return jnp.zeros(x.shape, jnp.bool_)
    return jnp.signbit(x)


@RULES.register("aten.ldexp.Tensor")
def ldexp(ctx, x, other):
    # torch: mul(x, pow(2, other)), each rounded to the result dtype; 2^other as rules/math.py's
    # exp2 (2^f * 2^n, exact at integers)
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    e = as_array(other, compute)
    bound = scalar_like(2 * (jnp.finfo(compute).maxexp - 2), e)
    e = jnp.clip(e, -bound, bound)
    n = jnp.round(e)
    power = _scale2(jnp.exp2(e - n), n).astype(dtype).astype(compute)
    return (as_array(x, compute) * power).astype(dtype)


@RULES.register("aten.angle.default")
def angle(ctx, x):
    # torch's real angle: NaN stays NaN, pi below 0, 0 elsewhere (-0.0 included)
    dtype = out_dtype(ctx)
    x = as_array(x, dtype)
    y = jnp.where(x < 0, scalar_like(math.pi, x), scalar_like(0, x))
    return jnp.where(jnp.isnan(x), x, y)


@RULES.register("aten.frexp.Tensor")
def frexp(ctx, x):
    # C's frexp: x = m * 2^e with |m| in [0.5, 1); m = x and e = 0 at 0, inf and NaN
    mantissa, exponent = jnp.frexp(x)
    special = (x == 0) | ~jnp.isfinite(x)
    mantissa = jnp.where(special, x, mantissa)
    exponent = jnp.where(special, jnp.zeros_like(exponent), exponent)
    return mantissa.astype(out_dtype(ctx, 0)), exponent.astype(out_dtype(ctx, 1))


# --------------------------------------------------------------------------- orthogonal polynomials
# torch's kernels: n = int64(n) (non-finite n as -1), 0 for n < 0, closed forms at n = 0, 1 and at
# the edges |x| = 1, then a three-term recurrence run n - 1 times (stopping once it is NaN). The
# loop's trip count is the largest n, known only at run time: xla only (SPECIAL_XLA).


def _degree(n):
    """torch's static_cast<int64_t>(n) as a float: truncated, -1 where n is not finite."""
    return jnp.where(jnp.isfinite(n), jnp.trunc(n), scalar_like(-1, n))


def _recurrence(n, p, q, step):
    """q after n - 1 steps (p, q) -> (q, step(i, p, q)), i = 0, 1, ...; each element stops after
    its own n - 1 steps or once q is NaN."""

    def active(i, q):
        return (i < n - 1) & ~jnp.isnan(q)

    def cond(state):
        i, _, q = state
        return jnp.any(active(i, q))

    def body(state):
        i, p, q = state
        go = active(i, q)
        r = step(i, p, q)
        return i + 1, jnp.where(go, q, p), jnp.where(go, r, q)

    _, _, q = jax.lax.while_loop(cond, body, (jnp.zeros((), n.dtype), p, q))
    return q


def _polynomial(first, step, edges=None):
    """A polynomial rule from its degree-1 value `first(x)`, its step `step(x, i, p, q)` and the
    kernel's closed forms `edges(x, n, y) -> y`."""

    def fn(x, n):
        x, n = jnp.broadcast_arrays(x, n)
        n = _degree(n)
        one = jnp.ones_like(x)
        q1 = first(x)
        y = _recurrence(n, one, q1, lambda i, p, q: step(x, i, p, q))
        y = jnp.where(n == 1, q1, y)
        y = jnp.where(n == 0, one, y)
        if edges is not None:
            y = edges(x, n, y)
        return jnp.where(n < 0, jnp.zeros_like(x), y)

    return fn


def _odd(n):
    return jnp.fmod(n, 2) != 0


def _chebyshev(kind: str, shifted: bool) -> Callable[..., jax.Array]:
    """torch's Chebyshev kernels of the first to fourth kind (t, u, v, w), on y = x or, shifted,
    y = 2x - 1: the values at y = +-1, the trigonometric form past a degree (cos(n acos y) and
    its kin, for |y| < 1), else the recurrence r = 2y q - p from (1, first(y))."""
    limit = {"t": 6, "u": 8, "v": 8, "w": 8}[kind] if not shifted else (4 if kind == "w" else 6)
    offset = {"t": None, "u": 0.0, "v": -1.0, "w": 1.0}[kind]

    def fn(x, n):
        x, n = jnp.broadcast_arrays(x, n)
        y = x + x - 1 if shifted else x
        first = (lambda y: y) if offset is None else (lambda y: y + y + offset)
        z = _polynomial(first, lambda y, i, p, q: (y + y) * q - p)(y, n)
        n = _degree(n)
        one = jnp.ones_like(y)
        sign = jnp.where(_odd(n), -one, one)
        theta = jnp.arccos(y)
        if kind == "t":
            trig = jnp.cos(n * theta)
            top, bottom = one, sign
        elif kind == "u":
            sin = jnp.sin(theta)
            fallback = (n + 1) * jnp.cos((n + 1) * theta) / y
            trig = jnp.where(sin != 0, jnp.sin((n + 1) * theta) / sin, fallback)
            top, bottom = n + 1, sign * (n + 1)
        elif kind == "v":
            bottom = sign * (n + n + 1)
            ratio = jnp.cos((n + 0.5) * theta) / jnp.cos(theta / 2)
            trig = jnp.where(jnp.sin(theta / 2) != 1, ratio, bottom)
            top = one
        else:
            top, bottom = n + n + 1, sign
            fallback = sign if shifted else jnp.where(y > 0, top, sign)
            ratio = jnp.sin((n + 0.5) * theta) / jnp.sin(theta / 2)
            trig = jnp.where(jnp.cos(theta / 2) != 1, ratio, fallback)
        z = jnp.where((n > limit) & (jnp.abs(y) < 1), trig, z)
        z = jnp.where(y == 1, top, jnp.where(y == -1, bottom, z))
        return jnp.where(n < 0, jnp.zeros_like(y), z)

    return fn


def _hermite_limit(x, n, y):
    return jnp.where(
        n > 128, scalar_like(jnp.nan, x), y
    )  # torch's float kernels: NaN past degree 128


_POLYNOMIALS = {
    "aten.special_chebyshev_polynomial_t.default": _chebyshev("t", False),
    "aten.special_chebyshev_polynomial_u.default": _chebyshev("u", False),
    "aten.special_chebyshev_polynomial_v.default": _chebyshev("v", False),
    "aten.special_chebyshev_polynomial_w.default": _chebyshev("w", False),
    "aten.special_shifted_chebyshev_polynomial_t.default": _chebyshev("t", True),
    "aten.special_shifted_chebyshev_polynomial_u.default": _chebyshev("u", True),
    "aten.special_shifted_chebyshev_polynomial_v.default": _chebyshev("v", True),
    "aten.special_shifted_chebyshev_polynomial_w.default": _chebyshev("w", True),
    "aten.special_hermite_polynomial_h.default": _polynomial(
        lambda x: x + x, lambda x, i, p, q: (x + x) * q - (2 * i + 2) * p, _hermite_limit
    ),
    "aten.special_hermite_polynomial_he.default": _polynomial(
        lambda x: x, lambda x, i, p, q: x * q - (i + 1) * p, _hermite_limit
    ),
    "aten.special_laguerre_polynomial_l.default": _polynomial(
        lambda x: 1 - x,
        lambda x, i, p, q: (((2 * i + 2) + (1 - x)) * q - (i + 1) * p) / (i + 2),
        lambda x, n, y: jnp.where(x == 0, jnp.ones_like(x), y),
    ),
    "aten.special_legendre_polynomial_p.default": _polynomial(
        lambda x: x,
        lambda x, i, p, q: ((2 * i + 3) * x * q - (i + 1) * p) / (i + 2),
        lambda x, n, y: jnp.where(
            jnp.abs(x) == 1,
            jnp.where((x > 0) | ~_odd(n), jnp.ones_like(x), -jnp.ones_like(x)),
            y,
        ),
    ),
}
for _name, _poly in _POLYNOMIALS.items():
    RULES.register(_name, platform="xla")(opmath_binary(_poly))  # names.SPECIAL_XLA
