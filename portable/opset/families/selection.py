"""Selection, scans and indexing beyond the core table: order statistics (median, kthvalue,
mode), running extrema, bucketing and histograms, strided and masked writes, copies of views."""

from __future__ import annotations

from ..entry import ANY, FLOAT, NUMERIC, OpDef, entry

ENTRIES: tuple[OpDef, ...] = (
    # running extrema and scans
    entry(
        "aten.cummax.default",
        NUMERIC,
        "tuple",
        "running max along dim and its index (a NaN sticks; ties, NaNs too, to the later index)",
    ),
    entry(
        "aten.cummin.default",
        NUMERIC,
        "tuple",
        "running min along dim and its index (a NaN sticks; ties, NaNs too, to the later index)",
    ),
    entry(
        "aten.logcumsumexp.default",
        FLOAT,
        "same",
        "log of the running sum of exp along dim, accumulated as max + log1p(exp(min - max))",
    ),
    # bucketing
    entry(
        "aten.searchsorted.Tensor",
        NUMERIC,
        "same",
        "per value, the insertion index into the sorted last dim (left: first >=, right: first >)",
    ),
    entry(
        "aten.bucketize.Tensor",
        NUMERIC,
        "same",
        "per element, the index of its bucket among the sorted 1-d boundaries (searchsorted)",
    ),
    # order statistics
    entry(
        "aten.median.default",
        NUMERIC,
        "reduce",
        "the lower median of all elements, NaN if any is NaN",
    ),
    entry(
        "aten.nanmedian.default",
        NUMERIC,
        "reduce",
        "the lower median of the non-NaN elements, NaN if all are NaN",
    ),
    entry(
        "aten.median.dim",
        NUMERIC,
        "tuple",
        "lower median along dim and its index in stable sorted order; a row's first NaN if any",
    ),
    entry(
        "aten.nanmedian.dim",
        NUMERIC,
        "tuple",
        "lower median of the non-NaN values along dim, its index in stable sorted order "
        "(an all-NaN row: NaN, index unspecified)",
    ),
    entry(
        "aten.kthvalue.default",
        NUMERIC,
        "tuple",
        "k-th smallest along dim (NaN largest) and the index torch's quickselect leaves there",
    ),
    entry(
        "aten.mode.default",
        NUMERIC,
        "tuple",
        "most frequent value along dim (the smallest among equally frequent) and an index of it",
    ),
    entry(
        "aten.nonzero_static.default",
        ANY,
        "creation",
        "[size, ndim] int64 indices of the nonzero elements in row-major order, padded with "
        "fill_value (or cut) to `size` rows",
    ),
)
TRAITS: dict[str, tuple[str, ...]] = {}
