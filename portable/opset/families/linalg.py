"""Linear algebra: factorizations (Cholesky, LU, QR, SVD, symmetric eigen), solves, inverses and
determinants. Rules exist for `xla` only: Neuron's compiler and ONNX have no factorization ops."""

from __future__ import annotations

from ..entry import OpDef

ENTRIES: tuple[OpDef, ...] = ()
TRAITS: dict[str, tuple[str, ...]] = {}
