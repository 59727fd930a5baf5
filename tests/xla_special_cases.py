"""The `xla` rule table's cases for the opset family `special` (rules/special.py,
rules/bessel.py). Builders and `Case` are in tests/xla_cases.py."""

from __future__ import annotations

import torch
from xla_cases import BF16, BOOL, F32, FLOATS, I64, A, C, pos, t

_INF, _NAN = float("inf"), float("nan")


def vals(dtype, *values):
    """Exactly these values (domain edges: poles, signed zeros, infinities, NaN)."""
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def wide(dtype, *shape):
    """Uniform in (-20, 20), both signs and past the range switches of the series."""
    return ((torch.rand(shape) * 2 - 1) * 20).to(dtype)


def unit(dtype, *shape):
    """Uniform in (-1, 1): the orthogonality interval of the Chebyshev and Legendre families."""
    return (torch.rand(shape) * 2 - 1).to(dtype)


def degrees(dtype, low, high, *shape):
    """Polynomial degrees n in [low, high), as the float tensor torch takes (truncated to int)."""
    return torch.randint(low, high, shape).to(dtype)


_CHEBYSHEV = [f"aten.special_chebyshev_polynomial_{k}.default" for k in "tuvw"]
_SHIFTED = [f"aten.special_shifted_chebyshev_polynomial_{k}.default" for k in "tuvw"]
_HERMITE = [
    "aten.special_hermite_polynomial_h.default",
    "aten.special_hermite_polynomial_he.default",
]
# degree n: one NaN and an inf (torch: int64(n) undefined / -1 -> 0), fractional and negative n
_DEGREE_EDGES = (0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 9.0, 10.0, 2.5, -1.0, -0.5)

_EDGES = (0.0, -0.0, 1.0, -1.0, -2.5, 0.5, 1e-30, 30.0, 1e30, _INF, -_INF, _NAN)
# polygamma / zeta: poles at 0 and negative integers, and negative q shifted term by term
_POLES = (0.0, -0.0, -1.0, -3.0, -2.5, -0.25, -7.75, -18.4, 1e-20, 0.5, 1e10, _INF, _NAN)

# bit-level results: no rounding to allow for
EXACT_SPECIAL = {
    "aten.nextafter.default",
    "aten.fmax.default",
    "aten.fmin.default",
    "aten.signbit.default",
    "aten.frexp.Tensor",
    "aten.angle.default",
    "aten.ldexp.Tensor",
}

# the Bessel and Airy kernels of torch's special_* namespace (no bfloat16 in torch)
_BESSEL = (
    "aten.special_modified_bessel_i0.default",
    "aten.special_modified_bessel_i1.default",
    "aten.special_spherical_bessel_j0.default",
    "aten.special_bessel_j0.default",
    "aten.special_bessel_j1.default",
    "aten.special_bessel_y0.default",
    "aten.special_bessel_y1.default",
    "aten.special_airy_ai.default",
)
_BESSEL_K = (
    "aten.special_modified_bessel_k0.default",
    "aten.special_modified_bessel_k1.default",
    "aten.special_scaled_modified_bessel_k0.default",
    "aten.special_scaled_modified_bessel_k1.default",
)


_SPECIAL: list = [
    # near a pole, psi_n(x) ~ n! / (x - k)^(n+1): the rounding of pi r in cot(pi r) is amplified
    # (n + 1)-fold, up to 2e-6 relative for n = 4 (torch sums in double)
    *[
        C(
            "aten.polygamma.default",
            lambda d, n=n: A(n, wide(d, 4, 8)),
            FLOATS,
            f"n{n}",
            tol=(1e-5, 1e-6) if n >= 4 else None,
        )
        for n in range(5)
    ],
    *[
        C("aten.polygamma.default", lambda d, n=n: A(n, vals(d, *_POLES)), (F32,), f"poles{n}")
        for n in range(5)
    ],
    *[
        C(op, lambda d: A(wide(d, 4, 8)), FLOATS)
        for op in (
            "aten.i0.default",
            "aten.special_i1.default",
            "aten.special_i1e.default",
        )
    ],
    # bfloat16 i0e is refused (rules/special.py): torch's own result depends on the position
    C("aten.special_i0e.default", lambda d: A(wide(d, 4, 8)), (F32,)),
    # the special_* Bessel kernels have no bfloat16 in torch
    *[C(op, lambda d: A(wide(d, 4, 8)), (F32,)) for op in _BESSEL],
    *[C(op, lambda d: A(pos(d, 4, 8) * 4), (F32,)) for op in _BESSEL_K],
    *[C(op, lambda d: A(vals(d, *_EDGES)), (F32,), "edges") for op in _BESSEL_K],
    # torch's CPU kernels of erfcx and ndtri have no bfloat16
    C("aten.special_erfcx.default", lambda d: A(wide(d, 4, 8)), (F32,)),
    *[
        C(op, lambda d: A(vals(d, *_EDGES)), (F32,), "edges")
        for op in (
            "aten.i0.default",
            "aten.special_i0e.default",
            "aten.special_i1.default",
            "aten.special_i1e.default",
            "aten.special_erfcx.default",
            *_BESSEL,
        )
    ],
    C(
        "aten.special_erfcx.default",
        lambda d: A(vals(d, -9, -6.2, -3, 2.9, 5, 9.4, 60, 1e8)),
        (F32,),
        "tail",
    ),
    C("aten.special_ndtri.default", lambda d: A(torch.rand(4, 8).to(d)), (F32,)),
    C(
        "aten.special_ndtri.default",
        lambda d: A(vals(d, 0, 1, 0.5, 1e-30, 0.9999999, -0.5, 1.5, _NAN)),
        (F32,),
        "edges",
    ),
    *[
        C(op, lambda d: A(pos(d, 4, 8) * 4, pos(d, 4, 8) * 4), FLOATS)
        for op in ("aten.igamma.default", "aten.igammac.default")
    ],
    *[
        C(
            op,
            lambda d: A(
                vals(d, 0, 0, 1, -1, 2, _INF, _INF, 3, _NAN, 2, 0.5, 40),
                vals(d, 0, 1, 0, 1, -1, 1, _INF, _INF, 1, _NAN, 1e-20, 30),
            ),
            (F32,),
            "edges",
        )
        for op in ("aten.igamma.default", "aten.igammac.default")
    ],
    C("aten.nextafter.default", lambda d: A(t(d, 3, 4), t(d, 3, 4)), FLOATS),
    C(
        "aten.nextafter.default",
        lambda d: A(
            vals(d, 0, -0.0, 1, _INF, 1, _NAN, 3.4e38), vals(d, 1, -1, 1, 0, _NAN, 1, _INF)
        ),
        (F32,),
        "edges",
    ),
    *[
        C(op, lambda d: A(t(d, 3, 4), t(d, 4)), (F32, BF16, I64))
        for op in ("aten.fmax.default", "aten.fmin.default")
    ],
    *[
        C(op, lambda d: A(vals(d, _NAN, 1, _NAN, -_INF), vals(d, 2, _NAN, _NAN, 0)), (F32,), "nan")
        for op in ("aten.fmax.default", "aten.fmin.default")
    ],
    C("aten.signbit.default", lambda d: A(t(d, 3, 4)), (F32, BF16, I64, BOOL)),
    C(
        "aten.signbit.default",
        lambda d: A(vals(d, 0.0, -0.0, _INF, -_INF, _NAN, -1e-30)),
        (F32,),
        "edges",
    ),
    C("aten.ldexp.Tensor", lambda d: A(t(d, 3, 4), t(d, 3, 4) * 4), FLOATS),
    C(
        "aten.ldexp.Tensor",
        lambda d: A(t(d, 3, 4), torch.randint(-20, 20, (3, 4)).to(d)),
        (F32,),
        "int",
    ),
    C("aten.angle.default", lambda d: A(t(d, 3, 4)), FLOATS),
    C(
        "aten.angle.default",
        lambda d: A(vals(d, 0.0, -0.0, -1, _NAN, -_INF, _INF)),
        (F32,),
        "edges",
    ),
    C("aten.frexp.Tensor", lambda d: A(t(d, 3, 4) * 100), FLOATS),
    C(
        "aten.frexp.Tensor",
        lambda d: A(vals(d, 0.0, -0.0, 1, -0.5, _INF, -_INF, _NAN, 3e38)),
        (F32,),
        "edges",
    ),
    # Airy Ai on both sides of its branch points -2.09, 2.09, 8.32 and its cut-off 103.892
    C(
        "aten.special_airy_ai.default",
        lambda d: A(vals(d, -30, -2.09, -2.0899, 2.0899, 2.09, 5, 8.3203353, 8.33, 103.892, 104)),
        (F32,),
        "branches",
    ),
    # orthogonal polynomials (torch has no bfloat16 kernels): the recurrence (n <= 6 and |x| > 1), the trigonometric forms past
    # n = 4..8 on (-1, 1), the values at x = +-1 (shifted: 0, 1) and negative / fractional n
    *[
        C(op, lambda d: A(t(d, 4, 8) * 1.5, degrees(d, -2, 7, 4, 8)), (F32,))
        for op in (*_CHEBYSHEV, *_SHIFTED, "aten.special_legendre_polynomial_p.default")
    ],
    # cos(n acos x) and kin: acos's last-ulp difference (XLA vs the C library) grows n-fold
    *[
        C(op, lambda d: A(unit(d, 4, 8), degrees(d, 7, 16, 4, 8)), (F32,), "trig", tol=(1e-5, 1e-5))
        for op in _CHEBYSHEV
    ],
    *[
        C(
            op,
            lambda d: A(torch.rand(4, 8).to(d), degrees(d, 5, 16, 4, 8)),
            (F32,),
            "trig",
            tol=(1e-5, 1e-5),
        )
        for op in _SHIFTED
    ],
    *[
        C(op, lambda d, v=v: A(vals(d, *[v] * 12), vals(d, *_DEGREE_EDGES)), (F32,), f"at{v}")
        for op in (*_CHEBYSHEV, "aten.special_legendre_polynomial_p.default")
        for v in (1.0, -1.0)
    ],
    *[
        C(op, lambda d, v=v: A(vals(d, *[v] * 12), vals(d, *_DEGREE_EDGES)), (F32,), f"at{v}")
        for op in _SHIFTED
        for v in (1.0, 0.0)
    ],
    # Hermite values grow as n! 2^n: 11 recurrence steps, each rounded, on values up to 1e8
    *[
        C(op, lambda d: A(t(d, 4, 8) * 3, degrees(d, -2, 12, 4, 8)), (F32,), tol=(1e-5, 1e-6))
        for op in _HERMITE
    ],
    *[
        C(
            op,
            lambda d: A(vals(d, 0.5, _NAN, 2, -1, 1e10), vals(d, 129, 3, 200, 128, 3)),
            (F32,),
            "limit",
        )
        for op in _HERMITE
    ],
    C(
        "aten.special_laguerre_polynomial_l.default",
        lambda d: A(pos(d, 4, 8) * 2, degrees(d, -2, 7, 4, 8)),
        (F32,),
    ),
    C(
        "aten.special_laguerre_polynomial_l.default",
        lambda d: A(vals(d, 0, 0, 0, 1, -3), vals(d, 0, 5, -1, 2.5, 4)),
        (F32,),
        "edges",
    ),
]
