"""The `xla` rule table's cases for the opset family `selection` (rules/selection.py). Builders and
`Case` are in tests/xla_cases.py."""

from __future__ import annotations

import math

import torch
from xla_cases import BF16, BOOL, F32, I64, A, C, small, t

FLOATS = (F32, BF16)
_NAN = math.nan


def _with_nan(d, *shape):
    x = small(d, *shape)
    x.view(-1)[1] = _NAN
    x.view(-1)[-2] = _NAN
    return x


def _sorted(d, *shape):
    return torch.sort(small(d, *shape), dim=-1).values


_SELECTION: list = [
    C("aten.cummax.default", lambda d: A(small(d, 4, 9), 1), (F32, BF16, I64), "ties"),
    C("aten.cummax.default", lambda d: A(_with_nan(d, 7, 3), 0), (F32,), "nan"),
    C("aten.cummax.default", lambda d: A(t(d), 0), (F32,), "0d"),
    C("aten.cummin.default", lambda d: A(small(d, 4, 9), -1), (F32, BF16, I64), "ties"),
    C("aten.cummin.default", lambda d: A(_with_nan(d, 3, 7), 1), (F32,), "nan"),
    C("aten.logcumsumexp.default", lambda d: A(t(d, 4, 9), 1), FLOATS),
    C(
        "aten.logcumsumexp.default",
        lambda d: A(torch.tensor([-math.inf, -math.inf, 1.0, math.inf, 2.0, math.inf]), 0),
        (F32,),
        "inf",
    ),
    C("aten.logcumsumexp.default", lambda d: A(_with_nan(d, 6, 2), 0), (F32,), "nan"),
    C("aten.searchsorted.Tensor", lambda d: A(_sorted(d, 9), small(d, 3, 4)), (F32, I64)),
    C(
        "aten.searchsorted.Tensor",
        lambda d: A(_sorted(d, 3, 8), small(d, 3, 5), right=True, out_int32=True),
        (F32, I64),
        "batched_right_int32",
    ),
    C(
        "aten.searchsorted.Tensor",
        lambda d: A(small(d, 7), small(d, 6), side="right", sorter=torch.argsort(small(d, 7))),
        (F32,),
        "side_sorter",
    ),
    C(
        "aten.searchsorted.Tensor",
        lambda d: A(torch.tensor([0.0, 1.0, _NAN, 3.0, _NAN]), torch.tensor([-1, 0.5, 2, _NAN])),
        (F32,),
        "nan",
    ),
    C("aten.bucketize.Tensor", lambda d: A(small(d, 4, 5), _sorted(d, 6)), (F32, I64)),
    C(
        "aten.bucketize.Tensor",
        lambda d: A(small(d, 4, 5), _sorted(d, 6), right=True, out_int32=True),
        (F32,),
        "right_int32",
    ),
    C("aten.median.default", lambda d: A(small(d, 4, 5)), (F32, BF16, I64)),
    C("aten.median.default", lambda d: A(_with_nan(d, 3, 3)), (F32,), "nan"),
    C("aten.nanmedian.default", lambda d: A(_with_nan(d, 4, 5)), (F32, BF16)),
    C("aten.nanmedian.default", lambda d: A(torch.full((3,), _NAN)), (F32,), "all_nan"),
    C("aten.median.dim", lambda d: A(small(d, 5, 40), 1), (F32, BF16, I64), "ties"),
    C("aten.median.dim", lambda d: A(_with_nan(d, 6, 4), 0, True), (F32,), "nan_keepdim"),
    C("aten.median.dim", lambda d: A(t(d), 0), (F32,), "0d"),
    C("aten.nanmedian.dim", lambda d: A(_with_nan(d, 4, 33), -1), (F32, BF16), "ties"),
    C("aten.nanmedian.dim", lambda d: A(_with_nan(d, 9, 3), 0, True), (F32,), "keepdim"),
    C("aten.kthvalue.default", lambda d: A(small(d, 6, 33), 17, 1), (F32, BF16, I64), "ties"),
    C("aten.kthvalue.default", lambda d: A(_with_nan(d, 9, 4), 9, 0, True), (F32,), "nan_last"),
    C("aten.kthvalue.default", lambda d: A(_with_nan(d, 4, 7), 2), (F32,), "nan"),
    C("aten.kthvalue.default", lambda d: A(t(d, 3, 2), 1, 1), (F32,), "two"),
    C("aten.mode.default", lambda d: A(small(d, 5, 16), 1), (F32, BF16, I64), "ties"),
    C("aten.mode.default", lambda d: A(small(d, 7, 3), 0, True), (F32,), "keepdim"),
    C("aten.mode.default", lambda d: A(_with_nan(d, 4, 9)), (F32,), "nan"),
]


def _sparse(dtype, *shape):
    """About half the elements zero (False for bool)."""
    mask = torch.rand(shape) < 0.5
    return (t(dtype, *shape) * mask).to(dtype) if dtype != BOOL else mask


_SELECTION += [
    C(
        "aten.nonzero_static.default",
        lambda d: A(_sparse(d, 3, 4), size=4),
        (F32, I64, BOOL),
        "cut",
    ),
    C(
        "aten.nonzero_static.default",
        lambda d: A(_sparse(d, 2, 3), size=9, fill_value=-7),
        (F32,),
        "pad",
    ),
    C("aten.nonzero_static.default", lambda d: A(_sparse(d, 5), size=5), (BF16,), "1d"),
]
