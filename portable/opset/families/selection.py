"""Selection, scans and indexing beyond the core table: order statistics (median, kthvalue,
mode), running extrema, bucketing and histograms, strided and masked writes, copies of views."""

from __future__ import annotations

from ..entry import OpDef

ENTRIES: tuple[OpDef, ...] = ()
TRAITS: dict[str, tuple[str, ...]] = {}
