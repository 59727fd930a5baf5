"""The `xla` rule table's cases, part 1: input builders and the core ATen ops (elementwise,
reductions, losses, matmul, shape, creation). The harness and the policy (tolerances, exact ops,
exclusions) are in tests/test_xla_rules.py; nn, portable and symbolic cases in
tests/xla_nn_cases.py."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

aten = torch.ops.aten
F32, BF16, F64, I64, BOOL = torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool
FLOATS = (F32, BF16)
INT64_MAX = 2**63 - 1

# --------------------------------------------------------------------------- input builders


def t(dtype, *shape):
    """Random values of `dtype`: normal floats, ints in [-5, 5), or bools."""
    if dtype == BOOL:
        return torch.randint(0, 2, shape).bool()
    if not dtype.is_floating_point:
        return torch.randint(-5, 5, shape, dtype=dtype)
    return torch.randn(shape).to(dtype)


def pos(dtype, *shape):
    """Positive floats in [0.5, 2): for sqrt, log, fractional powers."""
    return (torch.rand(shape) * 1.5 + 0.5).to(dtype)


def small(dtype, *shape):
    """Integers in [-2, 2] as `dtype`: comparisons see ties."""
    return torch.randint(-2, 3, shape).to(dtype)


def distinct(dtype, *shape):
    """Distinct values (no ties for top-k / argmax / max pooling), exact in bfloat16."""
    n = math.prod(shape)
    return (torch.randperm(n).reshape(shape) - n // 2).to(dtype) / 4


def idx(high, *shape):
    return torch.randint(0, high, shape)


@dataclasses.dataclass(frozen=True)
class Call:
    args: tuple
    kwargs: dict


def A(*args, **kwargs) -> Call:  # noqa: N802 (reads as the argument list of the call)
    return Call(args, kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    make: Callable[[torch.dtype], Call]
    dtypes: tuple[torch.dtype, ...] = (F32,)
    label: str = ""
    tol: tuple[float, float] | None = None  # float32 (rtol, atol) override, with a reason
    meta_only: bool = False  # the values are unspecified (empty*): compare shape and dtype


def C(op, make, dtypes=(F32,), label="", **kw) -> Case:  # noqa: N802
    return Case(op, make, tuple(dtypes), label, **kw)


# --------------------------------------------------------------------------- the table

_ELEMENTWISE = [
    C("aten.add.Tensor", lambda d: A(t(d, 3, 4), t(d, 4)), (F32, BF16, I64)),
    C("aten.add.Tensor", lambda d: A(t(d, 3, 4), t(d, 3, 4), alpha=2), (F32, I64), "alpha"),
    C("aten.add.Tensor", lambda d: A(t(I64, 3, 4), t(d, 3, 4)), FLOATS, "promote"),
    C("aten.add.Scalar", lambda d: A(t(d, 3, 4), 3), (F32, BF16, I64)),
    C("aten.add.Scalar", lambda d: A(t(I64, 3, 4), 2.5), (F32,), "int_plus_float"),
    C("aten.sub.Tensor", lambda d: A(t(d, 3, 4), t(d, 3, 1), alpha=3), (F32, BF16, I64)),
    C("aten.sub.Scalar", lambda d: A(t(d, 3, 4), 2), (F32, BF16, I64)),
    C("aten.rsub.Scalar", lambda d: A(t(d, 3, 4), 1.0), FLOATS),
    C("aten.rsub.Scalar", lambda d: A(t(d, 3, 4), 2, 3), (I64,), "alpha"),
    C("aten.mul.Tensor", lambda d: A(t(d, 3, 4), t(d, 3, 4)), (F32, BF16, I64, BOOL)),
    C("aten.mul.Tensor", lambda d: A(t(d, 3, 4), t(BOOL, 3, 4)), FLOATS, "bool_mask"),
    C("aten.mul.Scalar", lambda d: A(t(d, 3, 4), 0.5), (F32, BF16, I64)),
    C("aten.div.Tensor", lambda d: A(t(d, 3, 4), pos(F32, 3, 4).to(d)), FLOATS),
    C("aten.div.Tensor", lambda d: A(t(d, 3, 4), t(d, 3, 4).abs() + 1), (I64,), "int_true_div"),
    C(
        "aten.div.Tensor_mode",
        lambda d: A(t(d, 4, 5) * 3, t(d, 4, 5).abs() + 1, rounding_mode="floor"),
        (F32, I64),
        "floor",
    ),
    C(
        "aten.div.Tensor_mode",
        lambda d: A(t(d, 4, 5) * 3, -(t(d, 4, 5).abs() + 1), rounding_mode="trunc"),
        (F32, I64),
        "trunc",
    ),
    C("aten.div.Tensor_mode", lambda d: A(t(d, 4), pos(d, 4), rounding_mode=None), (F32,), "none"),
    C("aten.div.Scalar", lambda d: A(t(d, 3, 4), 3.0), (F32, BF16, I64)),
    C("aten.neg.default", lambda d: A(t(d, 3, 4)), (F32, BF16, I64)),
    C("aten.abs.default", lambda d: A(t(d, 3, 4)), (F32, BF16, I64)),
    *[
        C("aten.pow.Tensor_Scalar", lambda d, e=e: A(pos(d, 3, 4), e), FLOATS, f"exp{e}")
        for e in (2, 3, 0.5, -0.5, -1, -2, 1.7, 0)
    ],
    C("aten.pow.Tensor_Scalar", lambda d: A(t(d, 3, 4), 3), (I64,), "int"),
    C("aten.pow.Tensor_Tensor", lambda d: A(pos(d, 3, 4), t(d, 3, 4)), FLOATS),
    C("aten.pow.Scalar", lambda d: A(2.0, t(d, 3, 4)), FLOATS),
    *[
        C(f"aten.{name}.default", lambda d: A(t(d, 3, 4)), FLOATS)
        for name in ("exp", "tanh", "sigmoid", "sin", "cos", "erf")
    ],
    *[
        C(f"aten.{name}.default", lambda d: A(pos(d, 3, 4)), FLOATS)
        for name in ("sqrt", "rsqrt", "log", "reciprocal")
    ],
    C("aten.lerp.Scalar", lambda d: A(t(d, 3, 4), t(d, 3, 4), 0.3), FLOATS, "low"),
    C("aten.lerp.Scalar", lambda d: A(t(d, 3, 4), t(d, 4), 0.9), FLOATS, "high"),
    C("aten.addcmul.default", lambda d: A(t(d, 3, 4), t(d, 3, 4), t(d, 4), value=-0.5), FLOATS),
    C("aten.maximum.default", lambda d: A(t(d, 3, 4), t(d, 4)), (F32, BF16, I64)),
    C("aten.minimum.default", lambda d: A(t(d, 3, 4), t(d, 4)), (F32, BF16, I64)),
    C("aten.clamp.default", lambda d: A(t(d, 3, 4), -0.5, 0.5), FLOATS),
    C("aten.clamp.default", lambda d: A(t(d, 3, 4), None, 2), (I64,), "max_only"),
    C("aten.clamp_min.default", lambda d: A(t(d, 3, 4), 0.1), (F32, BF16, I64)),
    C("aten.clamp_max.default", lambda d: A(t(d, 3, 4), -1), (F32, BF16, I64)),
    C("aten.relu.default", lambda d: A(t(d, 3, 4)), (F32, BF16, I64)),
    C("aten.gelu.default", lambda d: A(t(d, 3, 4) * 2), FLOATS),
    C("aten.gelu.default", lambda d: A(t(d, 3, 4) * 2, approximate="tanh"), FLOATS, "tanh"),
    C("aten.gelu_backward.default", lambda d: A(t(d, 3, 4), t(d, 3, 4) * 2), FLOATS),
    C(
        "aten.gelu_backward.default",
        lambda d: A(t(d, 3, 4), t(d, 3, 4) * 2, approximate="tanh"),
        FLOATS,
        "tanh",
    ),
    C("aten.silu.default", lambda d: A(t(d, 3, 4) * 2), FLOATS),
    C("aten.silu_backward.default", lambda d: A(t(d, 3, 4), t(d, 3, 4) * 2), FLOATS),
    C("aten.threshold_backward.default", lambda d: A(t(d, 3, 4), small(d, 3, 4), 0), FLOATS),
    C("aten.tanh_backward.default", lambda d: A(t(d, 3, 4), torch.tanh(t(d, 3, 4))), FLOATS),
    C("aten.sigmoid_backward.default", lambda d: A(t(d, 3, 4), torch.sigmoid(t(d, 3, 4))), FLOATS),
    C("aten.where.self", lambda d: A(t(BOOL, 3, 4), t(d, 3, 4), t(d, 4)), (F32, BF16, I64, BOOL)),
    C("aten.bitwise_not.default", lambda d: A(t(d, 3, 4)), (BOOL, I64)),
    C("aten.bitwise_and.Tensor", lambda d: A(t(d, 3, 4), t(d, 4)), (BOOL, I64)),
    C("aten.bitwise_or.Tensor", lambda d: A(t(d, 3, 4), t(d, 4)), (BOOL, I64)),
    C("aten.logical_not.default", lambda d: A(small(d, 3, 4)), (BOOL, F32)),
    C("aten.logical_and.default", lambda d: A(small(d, 3, 4), small(d, 4)), (BOOL, F32)),
    C("aten.logical_or.default", lambda d: A(small(d, 3, 4), small(d, 4)), (BOOL, F32)),
    *[
        C(f"aten.{cmp}.Scalar", lambda d: A(small(d, 3, 4), 1), (F32, BF16, I64))
        for cmp in ("eq", "ne", "lt", "le", "gt", "ge")
    ],
    C("aten.lt.Scalar", lambda d: A(small(d, 3, 4), 0.5), (I64,), "int_vs_float"),
    *[
        C(f"aten.{cmp}.Tensor", lambda d: A(small(d, 3, 4), small(d, 4)), (F32, BF16, I64))
        for cmp in ("eq", "ne", "lt", "le", "gt", "ge")
    ],
    C("aten.eq.Tensor", lambda d: A(t(d, 3, 4), t(d, 3, 4)), (BOOL,), "bool"),
    C(
        "aten.isnan.default",
        lambda d: A(torch.tensor([1.0, math.nan, -math.inf, 0.0]).to(d)),
        FLOATS,
    ),
]

_REDUCTIONS = [
    C("aten.sum.dim_IntList", lambda d: A(t(d, 3, 4, 5), [1]), (F32, BF16, I64, BOOL)),
    C("aten.sum.dim_IntList", lambda d: A(t(d, 3, 4, 5), [0, -1], True), (F32, BF16), "keepdim"),
    C("aten.sum.dim_IntList", lambda d: A(t(d, 3, 4), None), (F32, I64), "all"),
    C("aten.sum.dim_IntList", lambda d: A(t(d, 3, 4), []), (F32,), "empty_dims"),
    C("aten.sum.dim_IntList", lambda d: A(t(I64, 3, 4), [1], dtype=d), (F32,), "dtype"),
    C("aten.sum.default", lambda d: A(t(d, 3, 4)), (F32, BF16, I64, BOOL)),
    C("aten.mean.dim", lambda d: A(t(d, 3, 4, 5), [1]), FLOATS),
    C("aten.mean.dim", lambda d: A(t(d, 3, 4, 5), [-1, 0], True), FLOATS, "keepdim"),
    C("aten.mean.dim", lambda d: A(t(d, 3, 4), None), (F32,), "all"),
    C("aten.mean.dim", lambda d: A(t(BF16, 3, 4), [1], dtype=d), (F32,), "dtype"),
    C("aten.mean.default", lambda d: A(t(d, 3, 4)), FLOATS),
    C("aten.amax.default", lambda d: A(t(d, 3, 4, 5), [1]), (F32, BF16, I64)),
    C("aten.amax.default", lambda d: A(t(d, 3, 4, 5), [], True), (F32,), "all_keepdim"),
    C("aten.amin.default", lambda d: A(t(d, 3, 4, 5), [-1, 0]), (F32, BF16, I64)),
    C("aten.max.dim", lambda d: A(distinct(d, 3, 4, 5), 1), (F32, BF16, I64)),
    C("aten.max.dim", lambda d: A(distinct(d, 3, 4), -1, True), (F32,), "keepdim"),
    C("aten.max.dim", lambda d: A(t(d, 3, 4), 1), (BOOL,), "bool"),
    C("aten.argmax.default", lambda d: A(distinct(d, 3, 4, 5), 1), (F32, I64)),
    C("aten.argmax.default", lambda d: A(distinct(d, 3, 4), None), (F32,), "flat"),
    C("aten.argmax.default", lambda d: A(distinct(d, 3, 4), None, True), (F32,), "flat_keepdim"),
    C("aten.var.correction", lambda d: A(t(d, 3, 4, 5), [1]), FLOATS),
    C("aten.var.correction", lambda d: A(t(d, 3, 4), None, correction=0), (F32,), "biased_all"),
    C(
        "aten.var.correction",
        lambda d: A(t(d, 3, 4, 5), [0, 2], correction=2, keepdim=True),
        (F32,),
        "correction2",
    ),
    C("aten.topk.default", lambda d: A(distinct(d, 3, 8), 3), (F32, BF16, I64)),
    C("aten.topk.default", lambda d: A(distinct(d, 5, 4), 2, 0, False), (F32, I64), "smallest"),
    C("aten.cumsum.default", lambda d: A(t(d, 3, 4), 1), (F32, BF16, I64, BOOL)),
    C("aten.cumsum.default", lambda d: A(t(d, 3, 4), -2, dtype=F32), (I64,), "dtype"),
    C("aten._softmax.default", lambda d: A(t(d, 3, 5) * 3, -1, False), FLOATS),
    C("aten._softmax.default", lambda d: A(t(d, 3, 5) * 3, 0, False), (F32,), "dim0"),
    C("aten._log_softmax.default", lambda d: A(t(d, 3, 5) * 3, 1, False), FLOATS),
    C(
        "aten._softmax_backward_data.default",
        lambda d: A(t(d, 3, 5), torch.softmax(t(d, 3, 5), -1), -1, d),
        FLOATS,
    ),
    C(
        "aten._log_softmax_backward_data.default",
        lambda d: A(t(d, 3, 5), torch.log_softmax(t(d, 3, 5), 0), 0, d),
        FLOATS,
    ),
]


def _nll(d, reduction, weight=True, rows=5):
    x = torch.log_softmax(t(d, rows, 4), -1)
    target = idx(4, rows)
    target[1] = -100  # ignored
    return x, target, (pos(d, 4) if weight else None), reduction, -100


def _nll_backward(d, reduction, weight=True):
    x, target, w, reduction, ignore = _nll(d, reduction, weight)
    _, total = aten.nll_loss_forward(x, target, w, reduction, ignore)
    grad = t(d, x.shape[0]) if reduction == 0 else t(d)
    return A(grad, x, target, w, reduction, ignore, total)


_LOSSES = [
    *[
        C("aten.mse_loss.default", lambda d, r=r: A(t(d, 3, 4), t(d, 3, 4), r), FLOATS, f"red{r}")
        for r in (0, 1, 2)
    ],
    *[
        C(
            "aten.mse_loss_backward.default",
            lambda d, r=r: A(t(d, 3, 4) if r == 0 else t(d), t(d, 3, 4), t(d, 3, 4), r),
            FLOATS,
            f"red{r}",
        )
        for r in (0, 1, 2)
    ],
    *[
        C("aten.nll_loss_forward.default", lambda d, r=r: A(*_nll(d, r)), (F32,), f"red{r}")
        for r in (0, 1, 2)
    ],
    C("aten.nll_loss_forward.default", lambda d: A(*_nll(d, 1, False)), (F32,), "unweighted"),
    C(
        "aten.nll_loss_forward.default",
        lambda d: A(torch.log_softmax(t(d, 4), 0), torch.tensor(2), None, 1, -100),
        (F32,),
        "1d",
    ),
    *[
        C("aten.nll_loss_backward.default", lambda d, r=r: _nll_backward(d, r), (F32,), f"red{r}")
        for r in (0, 1, 2)
    ],
    C("aten.nll_loss_backward.default", lambda d: _nll_backward(d, 1, False), (F32,), "unweighted"),
]

_MATMUL = [
    C("aten.mm.default", lambda d: A(t(d, 3, 8), t(d, 8, 5)), (F32, BF16, I64)),
    C("aten.bmm.default", lambda d: A(t(d, 2, 3, 8), t(d, 2, 8, 5)), (F32, BF16, I64)),
    C("aten.addmm.default", lambda d: A(t(d, 5), t(d, 3, 8), t(d, 8, 5)), (F32, BF16, I64)),
    C(
        "aten.addmm.default",
        lambda d: A(t(d, 3, 5), t(d, 3, 8), t(d, 8, 5), beta=0.5, alpha=2.0),
        (F32,),
        "scaled",
    ),
    C(
        "aten.addmm.default",
        lambda d: A(torch.full((5,), math.nan), t(d, 3, 8), t(d, 8, 5), beta=0),
        (F32,),
        "beta0_ignores_nan_bias",
    ),
]

_SHAPE = [
    C("aten.view.default", lambda d: A(t(d, 2, 6), [3, 4]), (F32, I64, BOOL)),
    C("aten.view.default", lambda d: A(t(d, 2, 6), [-1, 2]), (F32,), "infer"),
    C("aten._unsafe_view.default", lambda d: A(t(d, 2, 6), [12])),
    C("aten.reshape.default", lambda d: A(t(d, 2, 3, 2), [2, -1])),
    C("aten.permute.default", lambda d: A(t(d, 2, 3, 4), [2, 0, 1]), (F32, BOOL)),
    C("aten.permute.default", lambda d: A(t(d, 2, 3, 4), [-1, -3, 1]), (F32,), "negative"),
    C("aten.transpose.int", lambda d: A(t(d, 2, 3, 4), 0, -1), (F32, I64)),
    C("aten.transpose.int", lambda d: A(t(d, 5), 0, -1), (F32,), "1d"),
    C("aten.t.default", lambda d: A(t(d, 2, 3))),
    C("aten.t.default", lambda d: A(t(d, 3)), (F32,), "1d"),
    C("aten.unsqueeze.default", lambda d: A(t(d, 2, 3), 1), (F32, BOOL)),
    C("aten.unsqueeze.default", lambda d: A(t(d, 2, 3), -1), (F32,), "negative"),
    C("aten.squeeze.dims", lambda d: A(t(d, 1, 3, 1, 2), [0, 1, -2])),
    C("aten.squeeze.dim", lambda d: A(t(d, 3, 1), -1)),
    C("aten.squeeze.dim", lambda d: A(t(d, 3, 2), 0), (F32,), "not_size_one"),
    C("aten.expand.default", lambda d: A(t(d, 3, 1), [2, -1, 4]), (F32, I64)),
    C("aten.clone.default", lambda d: A(t(d, 2, 3), memory_format=torch.contiguous_format)),
    C("aten.alias.default", lambda d: A(t(d, 2, 3)), (F32, BOOL)),
    C("aten.lift_fresh_copy.default", lambda d: A(t(d, 2, 3)), (F32, I64)),
    C("aten._to_copy.default", lambda d: A(t(F32, 3, 4) * 4, dtype=d), (I64, BOOL, BF16, F64)),
    C("aten._to_copy.default", lambda d: A(t(I64, 3, 4), dtype=d), (F32, BOOL), "from_int"),
    C("aten._to_copy.default", lambda d: A(t(BOOL, 3, 4), dtype=d), (F32, I64), "from_bool"),
    C(
        "aten._to_copy.default",
        lambda d: A(t(d, 3, 4), dtype=d, layout=torch.strided, device=torch.device("cpu")),
        (F32,),
        "placement",
    ),
    C("aten.cat.default", lambda d: A([t(d, 2, 3), t(d, 2, 1)], 1), (F32, I64, BOOL)),
    C("aten.cat.default", lambda d: A([t(d, 2, 3), t(d, 4, 3)], -2), (F32,), "negative"),
    C("aten.cat.default", lambda d: A([t(d, 0), t(d, 2, 3), t(d, 1, 3)]), (F32,), "legacy_empty"),
    C("aten.cat.default", lambda d: A([t(d, 2), t(BF16, 3)]), (F32,), "promote"),
    C("aten.stack.default", lambda d: A([t(d, 2, 3), t(d, 2, 3)]), (F32, I64)),
    C("aten.stack.default", lambda d: A([t(d, 2, 3), t(d, 2, 3)], -1), (F32,), "last"),
    C("aten.split_with_sizes.default", lambda d: A(t(d, 3, 6), [2, 3, 1], 1), (F32, I64)),
    C("aten.split_with_sizes.default", lambda d: A(t(d, 4, 2), [1, 3]), (F32,), "dim0"),
    C("aten.slice.Tensor", lambda d: A(t(d, 4, 6), 1, 1, 4), (F32, I64)),
    C("aten.slice.Tensor", lambda d: A(t(d, 6, 3), 0, -4, INT64_MAX, 2), (F32,), "neg_start_max"),
    C("aten.slice.Tensor", lambda d: A(t(d, 6, 3), -2, None, 100), (F32,), "clamped"),
    C("aten.slice.Tensor", lambda d: A(t(d, 6, 3), 0, 4, 2), (F32,), "empty"),
    C("aten.slice_scatter.default", lambda d: A(t(d, 4, 6), t(d, 4, 3), 1, 1, 4), (F32, I64)),
    C(
        "aten.slice_scatter.default",
        lambda d: A(t(d, 7, 3), t(d, 2, 3), 0, -4, INT64_MAX, 2),
        (F32,),
        "step",
    ),
    C("aten.select.int", lambda d: A(t(d, 4, 6), 1, -1), (F32, I64)),
    C("aten.select.int", lambda d: A(t(d, 4, 6), 0, 2), (F32,), "dim0"),
    C("aten.select_scatter.default", lambda d: A(t(d, 4, 6), t(d, 4), 1, -2), (F32, I64)),
    C("aten.index.Tensor", lambda d: A(t(d, 5, 3), [idx(5, 4)]), (F32, I64, BOOL)),
    C("aten.index.Tensor", lambda d: A(t(d, 5, 3), [None, idx(3, 2, 2)]), (F32,), "none_first"),
    C(
        "aten.index.Tensor",
        lambda d: A(t(d, 5, 3, 4), [idx(5, 2, 1), None, idx(4, 3) - 4]),
        (F32,),
        "split_advanced_negative",
    ),
    C(
        "aten.index.Tensor",
        lambda d: A(t(d, 5, 3, 4), [idx(5, 2), idx(3, 2)]),
        (F32,),
        "adjacent_advanced",
    ),
    C(
        "aten.index_put.default",
        lambda d: A(t(d, 6, 3), [torch.randperm(6)[:4]], t(d, 4, 3)),
        (F32, I64),
    ),
    C(
        "aten.index_put.default",
        lambda d: A(t(d, 6, 3), [idx(6, 8)], t(d, 8, 3), True),
        (F32, I64),
        "accumulate_duplicates",
    ),
    C(
        "aten.index_put.default",
        lambda d: A(t(d, 4, 5), [None, torch.tensor([0, 3])], t(d, 1)),
        (F32,),
        "none_broadcast",
    ),
    C(
        "aten.index_put.default",
        lambda d: A(t(d, 4, 5), [t(BOOL, 4, 5)], torch.tensor(-1.0)),
        (F32,),
        "bool_mask_fill",
    ),
    C("aten.index_select.default", lambda d: A(t(d, 5, 3), 0, idx(5, 4)), (F32, I64)),
    C("aten.index_select.default", lambda d: A(t(d, 5, 3), -1, idx(3, 2)), (F32,), "last"),
    C("aten.gather.default", lambda d: A(t(d, 4, 5), 1, idx(5, 4, 3)), (F32, I64)),
    C("aten.gather.default", lambda d: A(t(d, 4, 5), 0, idx(4, 2, 3)), (F32,), "smaller_index"),
    C(
        "aten.scatter.src",
        lambda d: A(
            t(d, 3, 5), 1, torch.stack([torch.randperm(5)[:3] for _ in range(3)]), t(d, 3, 4)
        ),
        (F32, I64),
    ),
    C(
        "aten.scatter.value",
        lambda d: A(t(d, 3, 5), 1, torch.stack([torch.randperm(5)[:2] for _ in range(2)]), 1.5),
        (F32,),
    ),
    C("aten.scatter_add.default", lambda d: A(t(d, 3, 5), 1, idx(5, 3, 6), t(d, 3, 6)), (F32, I64)),
    C(
        "aten.scatter_add.default",
        lambda d: A(t(d, 4, 3), 0, idx(4, 2, 2), t(d, 3, 3)),
        (F32,),
        "smaller_index",
    ),
    C("aten.embedding.default", lambda d: A(t(d, 10, 4), idx(10, 2, 3)), (F32, BF16)),
    C(
        "aten.embedding_dense_backward.default",
        lambda d: A(t(d, 2, 5, 4), idx(6, 2, 5), 6, -1, False),
        FLOATS,
    ),
    C(
        "aten.embedding_dense_backward.default",
        lambda d: A(t(d, 2, 5, 4), torch.tensor([[0, 2, 2, 1, 0], [2, 3, 0, 2, 5]]), 6, 2, True),
        (F32,),
        "padding_idx_freq",
    ),
    C("aten.constant_pad_nd.default", lambda d: A(t(d, 2, 3, 4), [1, 2]), (F32, I64)),
    C(
        "aten.constant_pad_nd.default",
        lambda d: A(t(d, 2, 3, 4), [-1, 2, 0, 1], 1.5),
        (F32,),
        "negative_value",
    ),
    *[
        C(f"aten.{op}.default", lambda d, k=k: A(t(d, 2, 4, 5), k), (F32, I64, BOOL), f"diag{k}")
        for op in ("tril", "triu")
        for k in (0, 1, -2)
    ],
]

_PLACEMENT = {"layout": torch.strided, "device": torch.device("cpu"), "pin_memory": False}

_CREATION = [
    C("aten.full.default", lambda d: A([2, 3], 1.5, dtype=d, **_PLACEMENT), (F32, BF16)),
    C("aten.full.default", lambda d: A([2, 3], 7), (I64,), "default_dtype_int"),
    C("aten.full.default", lambda d: A([4], True, dtype=d), (BOOL,), "bool"),
    C("aten.full_like.default", lambda d: A(t(F32, 2, 3), 7, dtype=d), (F32, I64)),
    C("aten.full_like.default", lambda d: A(t(d, 2, 3), -math.inf), (F32,), "inf"),
    C("aten.zeros_like.default", lambda d: A(t(F32, 2, 3), dtype=d, **_PLACEMENT), (F32, I64)),
    C(
        "aten.ones_like.default",
        lambda d: A(t(d, 2, 3), memory_format=torch.preserve_format),
        (F32, BOOL),
    ),
    C(
        "aten.empty.memory_format",
        lambda d: A([2, 3], dtype=d, **_PLACEMENT),
        (F32, I64),
        meta_only=True,
    ),
    C(
        "aten.empty_permuted.default",
        lambda d: A([2, 3, 4], [2, 0, 1], dtype=d),
        (F32,),
        meta_only=True,
    ),
    C("aten.arange.start_step", lambda d: A(0, 10, 1, dtype=d, **_PLACEMENT), (I64, F32)),
    C("aten.arange.start_step", lambda d: A(10, -2, -3), (I64,), "negative_step"),
    C("aten.arange.start_step", lambda d: A(0.5, 3.0, 0.1, dtype=d), (F32,), "fractional"),
    C("aten.scalar_tensor.default", lambda d: A(3.5, dtype=d, **_PLACEMENT), (F32, I64, BF16)),
]


# float32 tolerance for gradients that sum ~100 products of O(1) terms (convolution weights)
