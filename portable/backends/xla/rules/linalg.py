"""Linear algebra (opset family `linalg`): factorizations, solves, inverses, determinants.
Registered for `xla` alone (names.LINALG): neuronx-cc has no factorization ops."""

from __future__ import annotations

from . import RULES  # noqa: F401
