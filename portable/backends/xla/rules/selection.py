"""Selection, scans and indexing beyond the core (opset family `selection`): order statistics,
running extrema, bucketing, histograms, strided and masked writes, copies of views."""

from __future__ import annotations

from . import RULES  # noqa: F401
