"""Special functions: polygamma, Bessel and related functions, orthogonal polynomials, incomplete
gamma, and float bit-level helpers (nextafter, frexp, ldexp, signbit)."""

from __future__ import annotations

from ..entry import ANY, ELEMENTWISE, FLOAT, NUMERIC, OpDef, entry

ENTRIES: tuple[OpDef, ...] = (
    entry(
        "aten.polygamma.default",
        FLOAT,
        "same",
        "n-th derivative of digamma: digamma (n = 0), trigamma (n = 1), (-1)^(n+1) n! zeta(n+1, x)",
    ),
    entry(
        "aten.special_zeta.default",
        FLOAT,
        "broadcast",
        "Hurwitz zeta sum_k (q + k)^-x (inf at x = 1 and q a non-positive integer, NaN for x < 1)",
    ),
    entry("aten.special_zeta.self_scalar", FLOAT, "broadcast", "special_zeta with a scalar x"),
    entry("aten.special_zeta.other_scalar", FLOAT, "broadcast", "special_zeta with a scalar q"),
    entry("aten.i0.default", FLOAT, "same", "modified Bessel function of the first kind, order 0"),
    entry("aten.special_i0e.default", FLOAT, "same", "exp(-|x|) i0(x)"),
    entry(
        "aten.special_i1.default",
        FLOAT,
        "same",
        "modified Bessel function of the first kind, order 1",
    ),
    entry("aten.special_i1e.default", FLOAT, "same", "exp(-|x|) i1(x)"),
    entry(
        "aten.special_airy_ai.default",
        FLOAT,
        "same",
        "Airy function Ai (NaN at +-inf, 0 past 103.892)",
    ),
    entry("aten.special_bessel_j0.default", FLOAT, "same", "Bessel function of the first kind J0"),
    entry("aten.special_bessel_j1.default", FLOAT, "same", "Bessel function of the first kind J1"),
    entry(
        "aten.special_bessel_y0.default",
        FLOAT,
        "same",
        "Bessel function of the second kind Y0 (-inf at 0, NaN below)",
    ),
    entry(
        "aten.special_bessel_y1.default",
        FLOAT,
        "same",
        "Bessel function of the second kind Y1 (-inf at 0, NaN below)",
    ),
    entry(
        "aten.special_modified_bessel_i0.default",
        FLOAT,
        "same",
        "modified Bessel function of the first kind I0 (as i0)",
    ),
    entry(
        "aten.special_modified_bessel_i1.default",
        FLOAT,
        "same",
        "modified Bessel function of the first kind I1 (as special_i1)",
    ),
    entry(
        "aten.special_modified_bessel_k0.default",
        FLOAT,
        "same",
        "modified Bessel function of the second kind K0 (inf at 0, NaN below)",
    ),
    entry(
        "aten.special_modified_bessel_k1.default",
        FLOAT,
        "same",
        "modified Bessel function of the second kind K1 (inf at 0, NaN below)",
    ),
    entry("aten.special_scaled_modified_bessel_k0.default", FLOAT, "same", "exp(x) K0(x)"),
    entry("aten.special_scaled_modified_bessel_k1.default", FLOAT, "same", "exp(x) K1(x)"),
    entry(
        "aten.special_spherical_bessel_j0.default",
        FLOAT,
        "same",
        "spherical Bessel function of the first kind j0 = sin(x) / x",
    ),
    entry(
        "aten.special_ndtri.default",
        FLOAT,
        "same",
        "inverse of the standard normal CDF (+-inf at 0, 1)",
    ),
    entry(
        "aten.special_erfcx.default",
        FLOAT,
        "same",
        "scaled complementary error function exp(x^2) erfc(x)",
    ),
    entry(
        "aten.igamma.default",
        FLOAT,
        "broadcast",
        "regularized lower incomplete gamma P(a, x) (self = a, other = x)",
    ),
    entry(
        "aten.igammac.default",
        FLOAT,
        "broadcast",
        "regularized upper incomplete gamma Q(a, x) = 1 - P(a, x)",
    ),
    entry("aten.nextafter.default", FLOAT, "broadcast", "the next float after self towards other"),
    entry(
        "aten.fmax.default", NUMERIC, "broadcast", "elementwise max ignoring NaN (NaN only if both)"
    ),
    entry(
        "aten.fmin.default", NUMERIC, "broadcast", "elementwise min ignoring NaN (NaN only if both)"
    ),
    entry("aten.signbit.default", ANY, "same", "the sign bit is set (bool; true for -0.0)"),
    entry(
        "aten.ldexp.Tensor", FLOAT, "broadcast", "self * 2^other (torch: mul(self, pow(2, other)))"
    ),
    entry(
        "aten.angle.default", FLOAT, "same", "argument of a real x: pi below 0, else 0 (NaN kept)"
    ),
    entry(
        "aten.special_chebyshev_polynomial_t.default",
        FLOAT,
        "broadcast",
        "Chebyshev polynomial of the first kind T_n(x), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_chebyshev_polynomial_u.default",
        FLOAT,
        "broadcast",
        "Chebyshev polynomial of the second kind U_n(x), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_chebyshev_polynomial_v.default",
        FLOAT,
        "broadcast",
        "Chebyshev polynomial of the third kind V_n(x), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_chebyshev_polynomial_w.default",
        FLOAT,
        "broadcast",
        "Chebyshev polynomial of the fourth kind W_n(x), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_shifted_chebyshev_polynomial_t.default",
        FLOAT,
        "broadcast",
        "shifted Chebyshev polynomial of the first kind T_n(2x - 1), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_shifted_chebyshev_polynomial_u.default",
        FLOAT,
        "broadcast",
        "shifted Chebyshev polynomial of the second kind U_n(2x - 1), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_shifted_chebyshev_polynomial_v.default",
        FLOAT,
        "broadcast",
        "shifted Chebyshev polynomial of the third kind V_n(2x - 1), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_shifted_chebyshev_polynomial_w.default",
        FLOAT,
        "broadcast",
        "shifted Chebyshev polynomial of the fourth kind W_n(2x - 1), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_hermite_polynomial_h.default",
        FLOAT,
        "broadcast",
        "physicists' Hermite polynomial H_n(x) (NaN past n = 128 in float32); 0 for n < 0",
    ),
    entry(
        "aten.special_hermite_polynomial_he.default",
        FLOAT,
        "broadcast",
        "probabilists' Hermite polynomial He_n(x) (NaN past n = 128 in float32); 0 for n < 0",
    ),
    entry(
        "aten.special_laguerre_polynomial_l.default",
        FLOAT,
        "broadcast",
        "Laguerre polynomial L_n(x), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.special_legendre_polynomial_p.default",
        FLOAT,
        "broadcast",
        "Legendre polynomial P_n(x), n = int(n); 0 for n < 0",
    ),
    entry(
        "aten.frexp.Tensor",
        FLOAT,
        "tuple",
        "(mantissa in [0.5, 1) with x's sign, int32 exponent): x = mantissa * 2^exponent",
    ),
)

_ELEMENTWISE = tuple(e.name for e in ENTRIES if e.name not in ("aten.frexp.Tensor",))
TRAITS: dict[str, tuple[str, ...]] = {ELEMENTWISE: _ELEMENTWISE}
