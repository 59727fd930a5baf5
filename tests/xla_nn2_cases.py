"""The `xla` rule table's cases, part 5: group norm, interpolation, adaptive max and 3-d pooling,
diagonal and repeat (rules/nn.py, rules/resample.py, rules/shape.py). Builders and `Case` are in tests/xla_cases.py."""

from __future__ import annotations

import math

import torch
from xla_cases import BF16, BOOL, F32, I64, A, C, aten, distinct, pos, t

FLOATS = (F32, BF16)

# ops whose results must match exactly whatever the dtype (no arithmetic)
EXACT_NN: set[str] = {
    "aten.upsample_nearest2d.vec",
    "aten.upsample_nearest2d.default",
    "aten.adaptive_max_pool2d.default",
    "aten.max_pool3d_with_indices.default",
    "aten.diagonal_scatter.default",
}


def _distinct(d, *shape):
    """Distinct values without ties, integers for integer dtypes (`distinct` divides by 4)."""
    if d.is_floating_point:
        return distinct(d, *shape)
    n = math.prod(shape)
    return (torch.randperm(n).reshape(shape) - n // 2).to(d)


def _specials(d, *shape):
    """Distinct values with a NaN, two NaNs in one window and a window of -inf."""
    x = distinct(d, *shape)
    flat = x.view(-1)
    flat[3] = flat[5] = flat[-7] = math.nan
    x[..., :2, :2] = -math.inf
    return x


def _gn_args(d, shape=(2, 6, 4, 5), group=3, affine=True):
    n, c = shape[:2]
    w, b = (pos(d, c), t(d, c)) if affine else (None, None)
    return A(t(d, *shape), w, b, n, c, math.prod(shape[2:]), group, 1e-5)


def _max_backward(d, forward, x, *args):
    y, indices = forward(x, *args)
    if forward is aten.adaptive_max_pool2d:
        return A(t(d, *y.shape), x, indices)
    kernel, stride, padding, dilation, ceil_mode = args
    return A(t(d, *y.shape), x, kernel, stride, padding, dilation, ceil_mode, indices)


def _avg3d_backward(d, x, *args):
    return A(t(d, *aten.avg_pool3d(x, *args).shape), x, *args)


def _diagonal_scatter(d, shape, offset, dim1, dim2):
    x = t(d, *shape)
    src = t(d, *torch.diagonal(x, offset, dim1, dim2).shape)
    return A(x, src, offset, dim1, dim2)


_IMAGE = (2, 3, 5, 7)
_VOLUME = (2, 3, 6, 5, 7)

_GROUP_NORM = [
    C("aten.native_group_norm.default", lambda d: _gn_args(d), FLOATS),
    C(
        "aten.native_group_norm.default",
        lambda d: _gn_args(d, (3, 4, 9), 1, affine=False),
        FLOATS,
        "no_affine_1d_one_group",
    ),
    C(
        "aten.native_group_norm.default",
        lambda d: _gn_args(d, (2, 4, 3, 3, 2), 4),
        (F32,),
        "3d_group_per_channel",
    ),
    C(
        "aten.native_group_norm.default",
        lambda d: A(t(d, 2, 4, 6) * 3 + 5, pos(d, 4), None, 2, 4, 6, 2, 1e-3),
        (F32,),
        "offset_mean_weight_only",
    ),
]

_INTERPOLATION = [
    C("aten.upsample_bilinear2d.vec", lambda d: A(t(d, *_IMAGE), None, False, [2.0, 2.0]), FLOATS),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, *_IMAGE), [9, 4], True, None),
        FLOATS,
        "size_align_corners",
    ),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, *_IMAGE), [3, 11], False, None),
        FLOATS,
        "size_half_pixel",
    ),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, *_IMAGE), None, False, [1.7, 0.6]),
        FLOATS,
        "fractional_scales",
    ),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, *_IMAGE), None, True, [1.5, 3.0]),
        (F32,),
        "scales_align_corners",
    ),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, *_IMAGE), None, False, [1.1, 1.3]),
        (F32,),
        "same_height_copies",
    ),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, 1, 4, 3, 6), [1, 5], True, None),
        (F32,),
        "one_row",
    ),
    # out_h + out_w > 128: torch's generic kernel (weights stored in the input dtype)
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, 1, 2, 40, 90), None, False, [1.1, 1.3]),
        FLOATS,
        "large_output",
    ),
    C(
        "aten.upsample_bilinear2d.vec",
        lambda d: A(t(d, 1, 2, 30, 40), [61, 83], True, None),
        FLOATS,
        "large_output_align_corners",
    ),
    C("aten.upsample_nearest2d.vec", lambda d: A(t(d, *_IMAGE), None, [2.0, 2.0]), FLOATS),
    C(
        "aten.upsample_nearest2d.vec",
        lambda d: A(t(d, 1, 2, 5, 100), None, [1.1, 1.3]),
        FLOATS,
        "large_output_scale_keeps_height",
    ),
    C(
        "aten.upsample_nearest2d.vec",
        lambda d: A(t(d, *_IMAGE), [8, 3], None),
        FLOATS,
        "size",
    ),
    C(
        "aten.upsample_nearest2d.vec",
        lambda d: A(t(d, *_IMAGE), None, [1.5, 0.7]),
        (F32,),
        "fractional_scales",
    ),
    C(
        "aten.upsample_nearest2d.vec",
        lambda d: A(t(d, *_IMAGE), None, [3.0, 2.9]),
        (F32,),
        "scale_given_not_size_ratio",
    ),
    C("aten.upsample_nearest2d.default", lambda d: A(t(d, *_IMAGE), [7, 15]), FLOATS),
    C(
        "aten.upsample_nearest2d.default",
        lambda d: A(t(d, *_IMAGE), [11, 20], 2.3, 2.9),
        (F32,),
        "scales",
    ),
]

_POOLING = [
    C("aten.adaptive_max_pool2d.default", lambda d: A(distinct(d, 2, 3, 7, 9), [3, 4]), FLOATS),
    C(
        "aten.adaptive_max_pool2d.default",
        lambda d: A(distinct(d, 3, 5, 6), [7, 4]),
        (F32,),
        "unbatched_upsampling",
    ),
    C(
        "aten.adaptive_max_pool2d.default",
        lambda d: A(_specials(d, 2, 3, 7, 9), [3, 4]),
        FLOATS,
        "nan_inf",
    ),
    C(
        "aten.adaptive_max_pool2d_backward.default",
        lambda d: _max_backward(d, aten.adaptive_max_pool2d, distinct(d, 2, 3, 7, 9), [3, 4]),
        FLOATS,
    ),
    C(
        "aten.adaptive_max_pool2d_backward.default",
        lambda d: _max_backward(d, aten.adaptive_max_pool2d, distinct(d, 2, 3, 5, 6), [7, 4]),
        (F32,),
        "overlapping",
    ),
    C(
        "aten.max_pool3d_with_indices.default",
        lambda d: A(_distinct(d, *_VOLUME), [2, 2, 2]),
        (F32, BF16, I64),
    ),
    C(
        "aten.max_pool3d_with_indices.default",
        lambda d: A(_distinct(d, *_VOLUME), [3, 3, 2], [2, 1, 2], [1, 1, 0], [1, 2, 1], True),
        (F32, I64),
        "padded_dilated_ceil",
    ),
    C(
        "aten.max_pool3d_with_indices.default",
        lambda d: A(_distinct(d, 3, 4, 5, 5), [2, 3, 3], [1, 2, 2], [1, 1, 1]),
        (F32,),
        "unbatched",
    ),
    C(
        "aten.max_pool3d_with_indices.default",
        lambda d: A(_specials(d, *_VOLUME), [2, 3, 3], [2, 2, 2], [1, 1, 1]),
        (F32,),
        "nan_inf_padded",
    ),
    C(
        "aten.max_pool3d_with_indices_backward.default",
        lambda d: _max_backward(
            d,
            aten.max_pool3d_with_indices,
            distinct(d, *_VOLUME),
            [2, 2, 2],
            [2, 2, 2],
            [0] * 3,
            [1] * 3,
            False,
        ),
        FLOATS,
    ),
    C(
        "aten.max_pool3d_with_indices_backward.default",
        lambda d: _max_backward(
            d,
            aten.max_pool3d_with_indices,
            distinct(d, *_VOLUME),
            [3, 3, 3],
            [1, 2, 1],
            [1] * 3,
            [1] * 3,
            True,
        ),
        (F32,),
        "overlapping_ceil",
    ),
    # eager avg_pool3d has no bfloat16 kernel on CPU
    C("aten.avg_pool3d.default", lambda d: A(t(d, *_VOLUME), [2, 2, 2]), (F32,)),
    C(
        "aten.avg_pool3d.default",
        lambda d: A(t(d, *_VOLUME), [3, 3, 2], [2, 2, 1], [1, 1, 1], True, False),
        (F32,),
        "ceil_exclude_pad",
    ),
    C(
        "aten.avg_pool3d.default",
        lambda d: A(t(d, *_VOLUME), [3, 2, 3], [2, 2, 2], [1, 1, 1], True, True),
        (F32,),
        "ceil_include_pad",
    ),
    C(
        "aten.avg_pool3d.default",
        lambda d: A(t(d, 3, 4, 4, 6), [2, 2, 2], [], 0, False, True, 5),
        (F32,),
        "unbatched_divisor_override",
    ),
    C(
        "aten.avg_pool3d_backward.default",
        lambda d: _avg3d_backward(
            d, t(d, *_VOLUME), [3, 3, 3], [2, 2, 2], [1] * 3, True, False, None
        ),
        (F32,),
    ),
    C(
        "aten.avg_pool3d_backward.default",
        lambda d: _avg3d_backward(d, t(d, *_VOLUME), [2, 2, 2], [1, 1, 1], [0] * 3, False, True, 3),
        (F32,),
        "overlapping_divisor_override",
    ),
    C("aten._adaptive_avg_pool3d.default", lambda d: A(t(d, *_VOLUME), [2, 3, 4]), FLOATS),
    C(
        "aten._adaptive_avg_pool3d.default",
        lambda d: A(t(d, 3, 2, 3, 4), [3, 4, 1]),
        (F32,),
        "unbatched_upsampling",
    ),
    C(
        "aten._adaptive_avg_pool3d.default",
        lambda d: A(t(d, 2, 3, 8, 8, 8), [1, 1, 1]),
        FLOATS,
        "global",
    ),
    C(
        "aten._adaptive_avg_pool3d_backward.default",
        lambda d: A(t(d, 2, 3, 2, 3, 4), t(d, *_VOLUME)),
        FLOATS,
    ),
]

_LAYOUT = [
    C("aten.diagonal.default", lambda d: A(t(d, 3, 4, 5), 1, 0, 2), (F32, I64, BOOL)),
    C("aten.diagonal.default", lambda d: A(t(d, 4, 6)), (F32,), "default"),
    C("aten.diagonal.default", lambda d: A(t(d, 2, 4, 5), -2, -1, 1), (F32,), "negative"),
    C("aten.diagonal.default", lambda d: A(t(d, 3, 4), 7), (F32,), "empty"),
    C(
        "aten.diagonal_scatter.default",
        lambda d: _diagonal_scatter(d, (3, 4, 5), 1, 1, 2),
        (F32, BF16, I64, BOOL),
    ),
    C(
        "aten.diagonal_scatter.default",
        lambda d: _diagonal_scatter(d, (5, 3, 4), -2, -1, 0),
        (F32,),
        "negative",
    ),
    C("aten.repeat.default", lambda d: A(t(d, 2, 3), [2, 1]), (F32, BF16, I64, BOOL)),
    C("aten.repeat.default", lambda d: A(t(d, 2, 3), [2, 1, 3]), (F32,), "new_dims"),
    C("aten.repeat.default", lambda d: A(t(d, 4), [0, 2]), (F32,), "zero"),
]

_NN_2: list = [*_GROUP_NORM, *_INTERPOLATION, *_POOLING, *_LAYOUT]
