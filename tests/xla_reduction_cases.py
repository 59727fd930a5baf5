"""The `xla` rule table's cases, part 4: reductions, sorting, selection and scans beyond part 1
(rules/reductions.py, rules/sorting.py). Builders and `Case` are in tests/xla_cases.py."""

from __future__ import annotations

import math

import torch
from xla_cases import BF16, BOOL, F32, I64, A, C, distinct, idx, pos, small, t

ALL = (F32, BF16, I64, BOOL)
NUMBERS = (F32, BF16, I64)

# ops whose results must match exactly whatever the dtype (selection, integer results)
EXACT_REDUCTIONS: set[str] = {
    "aten.argmin.default",
    "aten.min.dim",
    "aten.max.default",
    "aten.min.default",
    "aten.any.default",
    "aten.any.dim",
    "aten.any.dims",
    "aten.sort.default",
    "aten.sort.stable",
}


def nans(dtype, *shape):
    """Normal values with NaN, inf, -inf, 0.0 and -0.0 mixed in."""
    x = t(dtype, *shape).flatten()
    x[1], x[3], x[4], x[6], x[7] = math.nan, math.inf, -math.inf, 0.0, -0.0
    x[-1] = -math.nan
    return x.reshape(shape)


def scatter(dtype, reduce, include_self, rows=3, cols=5):
    """x [rows, cols] with src [4, cols + 1] reduced into it along dim 0 by an index [4, cols]
    (duplicate targets, rows never targeted)."""
    make = small if dtype in (I64, BOOL) else t
    index = idx(rows - 1, 4, cols)
    return A(
        make(dtype, rows, cols),
        0,
        index,
        make(dtype, 4, cols + 1),
        reduce,
        include_self=include_self,
    )


# ord -> the dtypes its case runs in
_ORDS = {2: (F32, BF16), 1: (F32, BF16), math.inf: (F32, BF16), -math.inf: (F32,), 0: (F32, BF16)}
_ORDS |= {3: (F32,), -1.5: (F32,)}
_NORMS = [
    C("aten.linalg_vector_norm.default", lambda d, p=p: A(t(d, 3, 4, 5), p, [1]), dtypes, f"ord{p}")
    for p, dtypes in _ORDS.items()
]

_REDUCTIONS_2: list = [
    C("aten.argmin.default", lambda d: A(distinct(d, 3, 4, 5), 1), NUMBERS),
    C("aten.argmin.default", lambda d: A(small(d, 4, 6), -1, True), (F32, I64), "ties_keepdim"),
    C("aten.argmin.default", lambda d: A(distinct(d, 3, 4)), (F32,), "flat"),
    C("aten.argmin.default", lambda d: A(distinct(d, 3, 4), None, True), (F32,), "flat_keepdim"),
    C("aten.argmin.default", lambda d: A(nans(d, 2, 8), 1), (F32,), "nan"),
    C("aten.argmin.default", lambda d: A(t(d), 0), (F32,), "0d"),
    C("aten.min.dim", lambda d: A(distinct(d, 3, 4, 5), 1), NUMBERS),
    C("aten.min.dim", lambda d: A(small(d, 4, 6), 0, True), (F32, I64, BOOL), "ties_keepdim"),
    C("aten.min.dim", lambda d: A(nans(d, 2, 8), -1), (F32,), "nan"),
    C("aten.min.dim", lambda d: A(t(d), -1), (F32,), "0d"),
    C("aten.max.default", lambda d: A(t(d, 3, 4)), ALL),
    C("aten.max.default", lambda d: A(nans(d, 2, 8)), (F32,), "nan"),
    C("aten.min.default", lambda d: A(t(d, 3, 4)), ALL),
    C("aten.min.default", lambda d: A(nans(d, 2, 8)), (F32, BF16), "nan"),
    C("aten.any.default", lambda d: A(small(d, 3, 4)), ALL),
    C("aten.any.default", lambda d: A(torch.zeros(3, 4, dtype=d)), ALL, "none"),
    C("aten.any.dim", lambda d: A(small(d, 3, 4), 1), ALL),
    C("aten.any.dim", lambda d: A(nans(d, 2, 8) * 0, 0, True), (F32,), "nan_keepdim"),
    C("aten.any.dims", lambda d: A(small(d, 2, 3, 4), [0, -1]), ALL),
    C("aten.any.dims", lambda d: A(small(d, 2, 3, 4), None, True), (F32, BOOL), "all_keepdim"),
    C("aten.any.dims", lambda d: A(small(d, 2, 3), []), (F32, I64), "no_dims"),
    C("aten.prod.default", lambda d: A(pos(d, 2, 4)), (F32, BF16)),
    C("aten.prod.default", lambda d: A(small(d, 3, 4) + (d != BOOL)), (I64, BOOL), "int"),
    C("aten.prod.default", lambda d: A(small(I64, 3, 4), dtype=d), (F32,), "dtype"),
    C("aten.prod.dim_int", lambda d: A(pos(F32, 3, 6), 1, dtype=d), (BF16,), "dtype_half"),
    C("aten.prod.dim_int", lambda d: A(t(d, 3, 4, 5), 1), (F32, BF16)),
    C("aten.prod.dim_int", lambda d: A(small(d, 3, 4), -1, True), (I64, BOOL), "int_keepdim"),
    C("aten.prod.dim_int", lambda d: A(nans(d, 2, 8), 1), (F32,), "nan"),
    C("aten.var_mean.correction", lambda d: A(t(d, 3, 4, 5), [1]), (F32, BF16)),
    C("aten.var_mean.correction", lambda d: A(t(d, 3, 4), None, correction=0), (F32,), "all"),
    C(
        "aten.var_mean.correction",
        lambda d: A(t(d, 3, 4, 5), [0, 2], correction=2, keepdim=True),
        (F32, BF16),
        "correction2_keepdim",
    ),
    *_NORMS,
    C("aten.linalg_vector_norm.default", lambda d: A(t(d, 3, 4)), (F32, BF16), "all"),
    C(
        "aten.linalg_vector_norm.default",
        lambda d: A(t(d, 3, 4, 5), 2, [0, 2], True),
        (F32,),
        "keepdim",
    ),
    C(
        "aten.linalg_vector_norm.default",
        lambda d: A(t(BF16, 3, 4), 2, [1], dtype=d),
        (F32,),
        "dtype",
    ),
    *[
        C(
            "aten.linalg_vector_norm.default",
            lambda d, p=p: A(nans(d, 2, 8), p, [1]),
            (F32,),
            f"nan{p}",
        )
        for p in (2, math.inf, -math.inf)
    ],
]

_SORTING: list = [
    C("aten.sort.default", lambda d: A(distinct(d, 3, 8)), NUMBERS),
    C("aten.sort.default", lambda d: A(distinct(d, 5, 4), 0, True), NUMBERS, "descending"),
    C("aten.sort.default", lambda d: A(t(d), 0), (F32,), "0d"),
    C("aten.sort.stable", lambda d: A(small(d, 3, 9), stable=True), ALL, "ties"),
    C(
        "aten.sort.stable",
        lambda d: A(small(d, 9, 3), stable=True, dim=0, descending=True),
        ALL,
        "ties_descending",
    ),
    C("aten.sort.stable", lambda d: A(nans(d, 2, 10), stable=True), (F32, BF16), "nan"),
    C(
        "aten.sort.stable",
        lambda d: A(nans(d, 2, 10), stable=True, descending=True),
        (F32,),
        "nan_descending",
    ),
    C("aten.cumprod.default", lambda d: A(pos(d, 3, 6), 1), (F32, BF16)),
    C("aten.cumprod.default", lambda d: A(small(d, 3, 6), 0), (I64, BOOL), "int"),
    C("aten.cumprod.default", lambda d: A(small(I64, 3, 4), -1, dtype=d), (F32,), "dtype"),
    *[
        C(
            "aten.scatter_reduce.two",
            lambda d, r=r, s=s: scatter(d, r, s),
            (F32, BF16, I64) if r == "mean" else ALL,
            f"{r}_{'self' if s else 'noself'}",
        )
        for r in ("sum", "prod", "mean", "amax", "amin")
        for s in (True, False)
    ],
    *[
        C(
            "aten.scatter_reduce.two",
            lambda d, r=r: A(nans(d, 3, 8), -1, idx(4, 3, 6), nans(d, 3, 6).flip(1), r),
            (F32,),
            f"{r}_nan_lastdim",
        )
        for r in ("sum", "amax", "amin")
    ],
]

_REDUCTIONS_2 += _SORTING
