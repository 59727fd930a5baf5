"""Spatial and pairwise ops (opset family `spatial`): grid sampling, antialiased and 3-d
resampling, pairwise distances, bilinear forms, embedding bags, matrix-vector products."""

from __future__ import annotations

from . import RULES  # noqa: F401
