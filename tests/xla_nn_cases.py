"""The `xla` rule table's cases, part 2: nn ops (conv, pooling, norms), the `portable::` ops
(attention, norms, scale-mask-softmax, MX, collectives) and symbolic size arithmetic. Builders
are in tests/xla_cases.py."""

from __future__ import annotations

from xla_cases import (
    BOOL,
    F32,
    FLOATS,
    I64,
    A,
    C,
    Call,
    aten,
    distinct,
    pos,
    t,
)

from portable import mx
from portable.mx.vectors import fuzz

_LONG_SUMS = (1e-5, 1e-5)


def _conv_args(d, n=2, groups=1, stride=1, padding=1, dilation=1, bias=True):
    x = t(d, 2, 4, *([7] * n))
    w = t(d, 6, 4 // groups, *([3] * n))
    b = t(d, 6) if bias else None
    return [x, w, b, [stride] * n, [padding] * n, [dilation] * n, False, [0] * n, groups]


def _conv_transposed_args(d):
    x, w = t(d, 2, 4, 5, 5), t(d, 4, 3, 3, 3)  # [C_in, C_out / groups, k, k] with groups 2
    return [x, w, t(d, 6), [2, 2], [1, 1], [1, 1], True, [1, 1], 2]


def _conv_backward(d, args, mask=(True, True, True)):
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
    y = aten.convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
    bias_sizes = list(b.shape) if b is not None else None
    return A(
        t(d, *y.shape),
        x,
        w,
        bias_sizes,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        list(mask),
    )


def _pool(d, shape=(2, 3, 8, 8)):
    return distinct(d, *shape)


def _max_pool_backward(d, x, *args):
    y, indices = aten.max_pool2d_with_indices(x, *args)
    kernel, stride, padding, dilation, ceil_mode = args
    return A(t(d, *y.shape), x, kernel, stride, padding, dilation, ceil_mode, indices)


def _avg_pool_backward(d, x, *args):
    y = aten.avg_pool2d(x, *args)
    return A(t(d, *y.shape), x, *args)


def _bn_args(d, weight=True):
    c = 3
    return [t(d, 4, c, 5, 5), pos(d, c) if weight else None, t(d, c) if weight else None]


def _bn_backward(d, train, mask=(True, True, True)):
    x, w, b = _bn_args(d)
    rm, rv = t(d, 3) * 0.1, pos(d, 3)
    _, mean, invstd, _, _ = aten._native_batch_norm_legit_functional(
        x, w, b, rm, rv, True, 0.1, 1e-5
    )
    if not train:
        mean, invstd = None, None
    return A(t(d, *x.shape), x, w, rm, rv, mean, invstd, train, 1e-5, list(mask))


def _ln_backward(d, weight=True, mask=(True, True, True)):
    x = t(d, 2, 3, 8)
    w, b = (pos(d, 8), t(d, 8)) if weight else (None, None)
    _, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
    return A(t(d, *x.shape), x, [8], mean, rstd, w, b, list(mask))


_NN = [
    C("aten.convolution.default", lambda d: A(*_conv_args(d)), FLOATS),
    C(
        "aten.convolution.default",
        lambda d: A(*_conv_args(d, groups=2, stride=2, padding=0, dilation=2, bias=False)),
        (F32,),
        "grouped_strided_dilated",
    ),
    C("aten.convolution.default", lambda d: A(*_conv_args(d, n=1, stride=2)), (F32,), "1d"),
    # 108-term sums (4 channels x 3^3) of outputs of order 10: how XLA:CPU orders them depends
    # on the host CPU's vector width, a few ulps of 10 apart
    C("aten.convolution.default", lambda d: A(*_conv_args(d, n=3)), (F32,), "3d", tol=_LONG_SUMS),
    C("aten.convolution.default", lambda d: A(*_conv_transposed_args(d)), (F32,), "transposed"),
    C(
        "aten.convolution_backward.default",
        lambda d: _conv_backward(d, _conv_args(d)),
        (F32,),
        tol=_LONG_SUMS,
    ),
    C(
        "aten.convolution_backward.default",
        lambda d: _conv_backward(d, _conv_args(d, groups=2, stride=2, dilation=2, bias=False)),
        (F32,),
        "grouped",
        tol=_LONG_SUMS,
    ),
    C(
        "aten.convolution_backward.default",
        lambda d: _conv_backward(d, _conv_args(d, n=1), (False, True, False)),
        (F32,),
        "1d_weight_only",
        tol=_LONG_SUMS,
    ),
    C(
        "aten.convolution_backward.default",
        lambda d: _conv_backward(d, _conv_transposed_args(d)),
        (F32,),
        "transposed",
        tol=_LONG_SUMS,
    ),
    C("aten.max_pool2d_with_indices.default", lambda d: A(_pool(d), [2, 2]), FLOATS),
    C(
        "aten.max_pool2d_with_indices.default",
        lambda d: A(_pool(d), [3, 3], [2, 2], [1, 1], [1, 1], True),
        (F32,),
        "padded_ceil",
    ),
    C(
        "aten.max_pool2d_with_indices.default",
        lambda d: A(_pool(d, (3, 9, 9)), [2, 3], [2, 1], [1, 0], [2, 1]),
        (F32,),
        "unbatched_dilated",
    ),
    C(
        "aten.max_pool2d_with_indices_backward.default",
        lambda d: _max_pool_backward(d, _pool(d), [2, 2], [2, 2], [0, 0], [1, 1], False),
        FLOATS,
    ),
    C(
        "aten.max_pool2d_with_indices_backward.default",
        lambda d: _max_pool_backward(d, _pool(d), [3, 3], [1, 1], [1, 1], [1, 1], False),
        (F32,),
        "overlapping",
    ),
    C("aten.avg_pool2d.default", lambda d: A(t(d, 2, 3, 8, 8), [2, 2]), FLOATS),
    C(
        "aten.avg_pool2d.default",
        lambda d: A(t(d, 2, 3, 7, 7), [3, 3], [2, 2], [1, 1], True, False),
        (F32,),
        "ceil_exclude_pad",
    ),
    C(
        "aten.avg_pool2d.default",
        lambda d: A(t(d, 2, 3, 7, 7), [3, 2], [2, 2], [1, 1], True, True),
        (F32,),
        "ceil_include_pad",
    ),
    C(
        "aten.avg_pool2d.default",
        lambda d: A(t(d, 3, 6, 6), [2, 2], [], 0, False, True, 3),
        (F32,),
        "divisor_override",
    ),
    C(
        "aten.avg_pool2d_backward.default",
        lambda d: _avg_pool_backward(
            d, t(d, 2, 3, 7, 7), [3, 3], [2, 2], [1, 1], True, False, None
        ),
        (F32,),
    ),
    C("aten._adaptive_avg_pool2d.default", lambda d: A(t(d, 2, 3, 8, 8), [1, 1]), FLOATS),
    C(
        "aten._adaptive_avg_pool2d.default",
        lambda d: A(t(d, 2, 3, 7, 5), [3, 2]),
        (F32,),
        "uneven",
    ),
    C(
        "aten._adaptive_avg_pool2d_backward.default",
        lambda d: A(t(d, 2, 3, 3, 2), t(d, 2, 3, 7, 5)),
        (F32,),
    ),
    C(
        "aten._native_batch_norm_legit_no_training.default",
        lambda d: A(*_bn_args(d), t(d, 3) * 0.1, pos(d, 3), 0.1, 1e-5),
        FLOATS,
    ),
    C(
        "aten._native_batch_norm_legit_functional.default",
        lambda d: A(*_bn_args(d), t(d, 3) * 0.1, pos(d, 3), True, 0.1, 1e-5),
        (F32,),
    ),
    C(
        "aten._native_batch_norm_legit_functional.default",
        lambda d: A(*_bn_args(d, weight=False), t(d, 3) * 0.1, pos(d, 3), False, 0.1, 1e-5),
        (F32,),
        "eval_no_affine",
    ),
    C("aten.native_batch_norm_backward.default", lambda d: _bn_backward(d, True), (F32,)),
    C(
        "aten.native_batch_norm_backward.default",
        lambda d: _bn_backward(d, False, (True, False, True)),
        (F32,),
        "eval",
    ),
    C(
        "aten.native_layer_norm.default",
        lambda d: A(t(d, 2, 3, 8), [8], pos(d, 8), t(d, 8), 1e-5),
        FLOATS,
    ),
    C(
        "aten.native_layer_norm.default",
        lambda d: A(t(d, 2, 3, 8), [3, 8], None, None, 1e-3),
        (F32,),
        "no_affine_2d",
    ),
    C("aten.native_layer_norm_backward.default", lambda d: _ln_backward(d), (F32,)),
    C(
        "aten.native_layer_norm_backward.default",
        lambda d: _ln_backward(d, False, (True, False, False)),
        (F32,),
        "no_affine",
    ),
]


def _qkv(d, hq=4, hk=4, lq=5, lk=5, dim=8):
    return t(d, 2, hq, lq, dim), t(d, 2, hk, lk, dim), t(d, 2, hk, lk, dim)


def _bool_mask(lq=5, lk=5):
    mask = t(BOOL, lq, lk)
    mask[:, 0] = True  # every query keeps a key (a fully masked row is NaN)
    return mask


_ATTENTION_VARIANTS = {
    "plain": lambda d: A(*_qkv(d)),
    "causal": lambda d: A(*_qkv(d), None, True),
    "causal_rect": lambda d: A(*_qkv(d, lq=4, lk=6), None, True),
    "bool_mask": lambda d: A(*_qkv(d), _bool_mask()),
    "additive_mask": lambda d: A(*_qkv(d), t(d, 2, 1, 5, 5)),
    "mask_and_causal": lambda d: A(*_qkv(d), _bool_mask(), True),
    "gqa_scale": lambda d: A(*_qkv(d, hq=4, hk=2), None, False, 0.3),
}
# float masks that require grad (attention_backward.mask_grad): dmask summed to each shape
_MASK_GRAD_VARIANTS = {
    "additive_mask": lambda d: A(*_qkv(d), t(d, 2, 1, 5, 5)),
    "broadcast_mask_causal": lambda d: A(*_qkv(d), t(d, 5, 5), True),
    "gqa_scale_per_head": lambda d: A(*_qkv(d, hq=4, hk=2), t(d, 1, 4, 5, 5), False, 0.3),
}


def _attention_backward(d, call: Call) -> Call:
    q, k, v, *rest = call.args
    return A(t(d, *q.shape[:-1], v.shape[-1]), q, k, v, *rest)


def _rms(d, weight=True, eps=None):
    return A(t(d, 2, 3, 8), [8], pos(d, 8) if weight else None, eps)


def _mx_input(d):
    return fuzz(5, 64).to(d)  # [64, 32]: NaN / Inf / zero blocks, subnormals, ties


def _mx_codes(fmt, axis):
    return mx.quantize(_mx_input(F32), fmt, axis, "floor")


def _collective(op, *args):
    return C(f"portable.{op}.default", lambda d: A(t(d, 2, 3), *args), (F32, I64))


_PORTABLE = [
    *[
        C("portable.attention.default", make, FLOATS, label, tol=(1e-5, 1e-6))
        for label, make in _ATTENTION_VARIANTS.items()
    ],
    *[
        C(
            "portable.attention_backward.default",
            lambda d, make=make: _attention_backward(d, make(d)),
            (F32,),
            label,
            tol=(1e-5, 1e-5),  # softmax gradients: sums of products of O(1) terms
        )
        for label, make in _ATTENTION_VARIANTS.items()
    ],
    *[
        C(
            "portable.attention_backward.mask_grad",
            lambda d, make=make: _attention_backward(d, make(d)),
            (F32,),
            label,
            tol=(1e-5, 1e-5),
        )
        for label, make in _MASK_GRAD_VARIANTS.items()
    ],
    C("portable.scale_mask_softmax.default", lambda d: A(t(d, 2, 3, 5), None, 0.5), FLOATS),
    C(
        "portable.scale_mask_softmax.default",
        lambda d: A(t(d, 2, 3, 5), _bool_mask(3, 5), 0.125, -1),
        FLOATS,
        "bool_mask",
    ),
    C(
        "portable.scale_mask_softmax.default",
        lambda d: A(t(d, 2, 3, 5), t(d, 3, 5), 2.0, 1),
        (F32,),
        "additive_mask_dim1",
    ),
    C("portable.rms_norm.default", lambda d: _rms(d), FLOATS),
    C("portable.rms_norm.default", lambda d: _rms(d, False, 1e-6), FLOATS, "no_weight_eps"),
    C(
        "portable.rms_norm_backward.default",
        lambda d: A(t(d, 2, 3, 8), *_rms(d).args),
        (F32,),
        tol=(1e-5, 1e-6),
    ),
    C(
        "portable.rms_norm_backward.default",
        lambda d: A(t(d, 2, 3, 8), *_rms(d, False, 1e-6).args),
        (F32,),
        "no_weight",
        tol=(1e-5, 1e-6),
    ),
    C("portable.layer_norm.default", lambda d: A(t(d, 2, 3, 8), [8], pos(d, 8), t(d, 8)), FLOATS),
    C("portable.layer_norm.default", lambda d: A(t(d, 2, 3, 8), [3, 8]), (F32,), "no_affine"),
    _collective("all_reduce", "sum", "dp", 1),
    _collective("all_gather", 0, "tp", 1),
    _collective("reduce_scatter", "avg", 1, "tp", 1),
    _collective("all_to_all", 0, 1, "ep", 1),
    _collective("local_shard", 0, "tp", 1),
    C("portable.wait.default", lambda d: A(t(d, 2, 3)), (F32, I64)),
    # MX: the bytes of portable.mx (tests/test_mx_backends.py has the full table)
    C("portable.mx_quantize.default", lambda d: A(_mx_input(d), "e4m3", -1, "rceil"), FLOATS),
    C("portable.mx_quantize.default", lambda d: A(_mx_input(d), "e2m1", 0), (F32,), "fp4_axis0"),
    C("portable.mx_dequantize.default", lambda d: A(*_mx_codes("e4m3", -1), "e4m3", -1, d), FLOATS),
    C(
        "portable.mx_dequantize.default",
        lambda d: A(*_mx_codes("e2m1", 0), "e2m1", 0, d, 32),
        (F32,),
        "fp4_axis0",
    ),
]

# size arithmetic: the graph reads sizes of its input with sym_size, combines them, and makes a
# tensor of that size (`_symbolic_program`); the case's args are the input and the op's operands
_SYMBOLIC = [
    C("aten.sym_size.int", lambda d: A(t(d, 6, 4), -1)),
    *[
        C(name, lambda d: A(t(d, 7, 3)))
        for name in ("sym.add", "sym.sub", "sym.mul", "sym.floordiv", "sym.mod")
    ],
]
