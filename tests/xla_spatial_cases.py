"""The `xla` rule table's cases for the opset family `spatial` (rules/spatial.py). Builders and
`Case` are in tests/xla_cases.py."""

from __future__ import annotations

import math

import torch
from xla_cases import BF16, F32, I64, A, C, aten, distinct, t

FLOATS = (F32, BF16)
_INF = math.inf


def _cdist_backward(d, r1, r2, p, batch=()):
    x1, x2 = t(d, *batch, r1, 4), t(d, *batch, r2, 4)
    x2[..., 0, :] = x1[..., 0, :]  # a zero distance: its gradient is 0
    out = aten._cdist_forward(x1, x2, p, None)
    return A(t(d, *out.shape), x1, x2, p, out)


def _pdist_backward(d, n, p):
    x = t(d, n, 3)
    x[1] = x[0]  # a zero distance
    out = aten._pdist_forward(x, p)
    return A(t(d, *out.shape), x, p, out)


def _adaptive_max3d_backward(d, x, size):
    y, indices = aten.adaptive_max_pool3d(x, size)
    return A(t(d, *y.shape), x, indices)


def _grid(d, *shape):
    """Grid coordinates in (-1.25, 1.25): some outside the input, to exercise the padding."""
    return ((torch.rand(shape) * 2 - 1) * 1.25).to(d)


def _sampler(d, dims, mode, padding, align):
    x = t(d, 2, 3, 5, 6) if dims == 2 else t(d, 2, 3, 4, 5, 6)
    grid = _grid(d, 2, 4, 3, 2) if dims == 2 else _grid(d, 2, 3, 4, 2, 3)
    return x, grid, mode, padding, align


def _sampler_backward(d, dims, mode, padding, align, mask=(True, True)):
    x, grid, *args = _sampler(d, dims, mode, padding, align)
    out = (
        aten.grid_sampler_2d(x, grid, *args) if dims == 2 else aten.grid_sampler_3d(x, grid, *args)
    )
    return A(t(d, *out.shape), x, grid, *args, list(mask))


# (mode, padding, align_corners): modes bilinear 0, nearest 1 (bicubic 2 is refused:
# test_spatial_refusals.py)
_SAMPLINGS = [(m, p, a) for m in (0, 1) for p in (0, 1, 2) for a in (False, True)]


_SPATIAL: list = [
    *[
        C(
            "aten.grid_sampler_2d.default",
            lambda d, m=m, p=p, a=a: A(*_sampler(d, 2, m, p, a)),
            FLOATS if (m, p, a) == (0, 0, False) else (F32,),
            f"mode{m}_pad{p}_align{a}",
        )
        for m, p, a in _SAMPLINGS
    ],
    *[
        C(
            "aten.grid_sampler_2d_backward.default",
            lambda d, m=m, p=p, a=a: _sampler_backward(d, 2, m, p, a),
            (F32,),
            f"mode{m}_pad{p}_align{a}",
        )
        for m, p, a in _SAMPLINGS
    ],
    C(
        "aten.grid_sampler_2d_backward.default",
        lambda d: _sampler_backward(d, 2, 0, 0, False, (False, True)),
        (F32,),
        "grid_only",
    ),
    *[
        C(
            "aten.grid_sampler_3d.default",
            lambda d, m=m, p=p, a=a: A(*_sampler(d, 3, m, p, a)),
            (F32,),
            f"mode{m}_pad{p}_align{a}",
        )
        for m, p, a in _SAMPLINGS
        if (p, a) != (2, False)  # refused (test_spatial_refusals.py)
    ],
    *[
        C(
            "aten.grid_sampler_3d_backward.default",
            lambda d, m=m, p=p, a=a: _sampler_backward(d, 3, m, p, a),
            (F32,),
            f"mode{m}_pad{p}_align{a}",
        )
        for m, p, a in _SAMPLINGS
        if (p, a) != (2, False)  # refused (test_spatial_refusals.py)
    ],
    C("aten.addmv.default", lambda d: A(t(d, 5), t(d, 5, 4), t(d, 4)), (F32, BF16, I64)),
    C(
        "aten.addmv.default",
        lambda d: A(t(d, 1), t(d, 5, 4), t(d, 4), beta=0.2, alpha=0.6),
        FLOATS,
        "scaled",
    ),
    C(
        "aten.addmv.default",
        lambda d: A(torch.full((5,), math.nan), t(d, 5, 4), t(d, 4), beta=0),
        (F32,),
        "beta0_ignores_nan",
    ),
    C("aten.addbmm.default", lambda d: A(t(d, 3, 5), t(d, 4, 3, 6), t(d, 4, 6, 5)), FLOATS),
    C(
        "aten.addbmm.default",
        lambda d: A(t(d, 5), t(d, 3, 3, 6), t(d, 3, 6, 5), beta=2, alpha=0.5),
        (F32, I64),
        "scaled_broadcast",
    ),
    C(
        "aten.addbmm.default",
        lambda d: A(torch.full((3, 5), math.nan), t(d, 2, 3, 4), t(d, 2, 4, 5), beta=0),
        (F32,),
        "beta0_ignores_nan",
    ),
    C(
        "aten.addbmm.default",
        lambda d: A(t(d, 3, 5), t(d, 0, 3, 4), t(d, 0, 4, 5), beta=3),
        (F32,),
        "no_batches",
    ),
    # F.bilinear: x1 [b, i], weight [o, i, j], x2 [b, j]
    C(
        "aten._trilinear.default",
        lambda d: A(t(d, 3, 4), t(d, 2, 4, 5), t(d, 3, 5), [1, 3], [0], [1, 2], [2, 3]),
        FLOATS,
    ),
    C(
        "aten._trilinear.default",
        lambda d: A(t(d, 3, 2, 4), t(d, 6, 4, 5), t(d, 3, 2, 5), [2, 4], [0, 1], [2, 3], [3, 4]),
        (F32,),
        "batch_dims",
    ),
    *[
        C("aten.dist.default", lambda d, p=p: A(t(d, 3, 4), t(d, 4), p), FLOATS, f"p{p}")
        for p in (2, 1, 0, 3, 0.5, _INF, -_INF)
    ],
    *[
        C(
            "aten._cdist_forward.default",
            lambda d, p=p: A(t(d, 5, 4), t(d, 6, 4), p, None),
            (F32,),
            f"p{p}",
        )
        for p in (2, 1, 0, 3, 0.5, _INF)
    ],
    C(
        "aten._cdist_forward.default",
        lambda d: A(t(d, 2, 30, 4), t(d, 1, 7, 4), 2.0, None),
        (F32,),
        "matmul_form",
        # |x1|^2 + |x2|^2 - 2 x1.x2 cancels as in torch's kernel; sqrt doubles its error
        tol=(1e-5, 1e-5),
    ),
    C(
        "aten._cdist_forward.default",
        lambda d: A(t(d, 5, 4), t(d, 6, 4), 2.0, 2),
        (F32,),
        "donot_use_mm",
    ),
    *[
        C(
            "aten._cdist_backward.default",
            lambda d, p=p: _cdist_backward(d, 5, 6, p),
            (F32,),
            f"p{p}",
        )
        for p in (2, 1, 0, 3, 1.5, 0.5, _INF)
    ],
    C(
        "aten._cdist_backward.default",
        lambda d: _cdist_backward(d, 3, 4, 2.0, (2,)),
        (F32,),
        "batched",
    ),
    *[
        C("aten._pdist_forward.default", lambda d, p=p: A(t(d, 6, 3), p), (F32,), f"p{p}")
        for p in (2, 1, 0, 3, 0.5, _INF)
    ],
    C("aten._pdist_forward.default", lambda d: A(t(d, 1, 3), 2.0), (F32,), "one_row"),
    *[
        C("aten._pdist_backward.default", lambda d, p=p: _pdist_backward(d, 5, p), (F32,), f"p{p}")
        for p in (2, 1, 0, 3, 1.5, 0.5, _INF)
    ],
    C(
        "aten.adaptive_max_pool3d.default",
        lambda d: A(distinct(d, 2, 2, 5, 6, 7), [2, 3, 4]),
        FLOATS,
    ),
    C(
        "aten.adaptive_max_pool3d.default",
        lambda d: A(distinct(d, 2, 3, 4, 5), [4, 5, 3]),
        (F32,),
        "unbatched_upsampling",
    ),
    C(
        "aten.adaptive_max_pool3d_backward.default",
        lambda d: _adaptive_max3d_backward(d, distinct(d, 2, 2, 5, 6, 7), [2, 3, 4]),
        FLOATS,
    ),
    C(
        "aten.adaptive_max_pool3d_backward.default",
        lambda d: _adaptive_max3d_backward(d, distinct(d, 1, 2, 3, 4, 5), [4, 5, 3]),
        (F32,),
        "overlapping",
    ),
]
