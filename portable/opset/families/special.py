"""Special functions: polygamma, Bessel and related functions, orthogonal polynomials, incomplete
gamma, and float bit-level helpers (nextafter, frexp, ldexp, signbit)."""

from __future__ import annotations

from ..entry import OpDef

ENTRIES: tuple[OpDef, ...] = ()
TRAITS: dict[str, tuple[str, ...]] = {}
