"""Spatial and pairwise ops: grid sampling, antialiased and 3-d resampling, pairwise distances,
bilinear forms, bags of embeddings and the matrix-vector products torch keeps whole."""

from __future__ import annotations

from ..entry import OpDef

ENTRIES: tuple[OpDef, ...] = ()
TRAITS: dict[str, tuple[str, ...]] = {}
