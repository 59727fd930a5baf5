"""Special functions (opset family `special`): polygamma, Bessel functions, orthogonal
polynomials, incomplete gamma and the float bit-level helpers."""

from __future__ import annotations

from . import RULES  # noqa: F401
