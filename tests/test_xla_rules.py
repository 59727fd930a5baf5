"""OpInfo-style table for the `xla` lowering rules: every opset op, forward and backward.

Each case builds small inputs, runs the op's torch overload eagerly (the `cpu` reference), wraps
the same call in a one-node Program and runs it through the backend's three stages (capability
check and lowering, XLA compile, run), then compares every output: exactly for integer and bool results and for `EXACT` ops (shape, layout,
indexing, creation), to per-dtype tolerances otherwise (`TOLERANCES`, loosened per case only with
a reason). `EXCLUDED` is the one reviewed list of ops without a rule; tests check that the table
and the exclusions together are the whole opset, and that the backend's declared capabilities
are exactly the ops this table runs. The rules are shared with `neuron`, which has no float64, so
a case whose inputs and outputs have no float64 must lower without any.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import portable
from portable import mx
from portable.backends import Target
from portable.backends.xla import XlaBackend
from portable.backends.xla.rules import load_rules
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import (
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    Signature,
    TensorSpec,
)
from portable.mx.vectors import fuzz
from portable.opset import opset_table

pytest.importorskip("jax")

aten = torch.ops.aten
F32, BF16, F64, I64, BOOL = torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool
FLOATS = (F32, BF16)
INT64_MAX = 2**63 - 1

# ops with no rule yet, and why (reviewed: adding an op to the opset must add a case or a line here)
EXCLUDED: dict[str, str] = {}

# (rtol, atol) by dtype. float32: ~1e-6 (a few ulps of O(1) values after short sums);
# bfloat16: one bf16 ulp (2^-8 relative), as torch and XLA may round an intermediate differently.
TOLERANCES = {F32: (1e-6, 1e-6), F64: (1e-12, 1e-12), BF16: (1.6e-2, 1e-2)}

# ops whose results must match exactly whatever the dtype (no arithmetic, or integer arithmetic)
EXACT = (
    {
        name
        for name in opset_table()
        if opset_table()[name].shape in ("view", "index", "concat", "creation")
        or name.startswith(("aten.sym_size", "sym."))
    }
    | {
        "aten.clone.default",
        "aten.alias.default",
        "aten._to_copy.default",
        "aten.lift_fresh_copy.default",
        "aten.full_like.default",
        "aten.zeros_like.default",
        "aten.ones_like.default",
        "aten.slice_scatter.default",
        "aten.select_scatter.default",
        "aten.scatter.src",
        "aten.scatter.value",
        "aten.tril.default",
        "aten.triu.default",
        "aten.max.dim",
        "aten.amax.default",
        "aten.amin.default",
        "aten.topk.default",
        "aten.max_pool2d_with_indices.default",
        "portable.wait.default",
        "portable.mx_dequantize.default",  # exact: element * 2^(scale - 127), rounded once
        "portable.all_reduce.default",
        "portable.all_gather.default",
        "portable.reduce_scatter.default",
        "portable.all_to_all.default",
    }
) - {
    "aten.embedding_dense_backward.default",  # sums rows
    "aten.index_put.default",  # accumulate=True sums duplicates
    "aten.arange.start_step",  # float aranges: torch rounds each SIMD block's base, within an ulp
}


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
    C("aten.convolution.default", lambda d: A(*_conv_args(d, n=3)), (F32,), "3d"),
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

CASES = [
    *_ELEMENTWISE,
    *_REDUCTIONS,
    *_LOSSES,
    *_MATMUL,
    *_SHAPE,
    *_CREATION,
    *_NN,
    *_PORTABLE,
    *_SYMBOLIC,
]


# --------------------------------------------------------------------------- harness


def _spec(value):
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(_spec(v) for v in value)
    return None


def _program(name: str, build: Callable[[torch.fx.Graph, Callable], list], inputs: list) -> Program:
    """A one-op inference Program: `build(graph, lift)` adds the op (lift turns a tensor into a
    placeholder) and returns [(node, value)] for the outputs."""
    graph = torch.fx.Graph()
    placeholders = []

    def lift(value):
        if isinstance(value, torch.Tensor):
            node = graph.placeholder(f"in{len(placeholders)}")
            node.meta["tensor"] = TensorSpec.of(value)
            placeholders.append((node, value))
            inputs.append(value)
            return node
        if isinstance(value, (list, tuple)):
            return type(value)(lift(v) for v in value)
        return value

    outputs = build(graph, lift)
    graph.output(tuple(node for node, _ in outputs))
    signature = Signature(
        tuple(InputSpec(n.name, InputKind.USER_INPUT, TensorSpec.of(v)) for n, v in placeholders),
        tuple(
            OutputSpec(f"out{i}", OutputKind.OUTPUT, TensorSpec.of(v))
            for i, (_, v) in enumerate(outputs)
        ),
    )
    module = torch.fx.GraphModule(torch.nn.Module(), graph)
    return Program(ProgramKind.INFERENCE, module, signature, {}, metadata={"name": name})


def _op_program(case: Case, call: Call, result, inputs: list) -> Program:
    target = opset_table()[case.op].overload

    def build(graph, lift):
        node = graph.call_function(
            target, lift(call.args), {k: lift(v) for k, v in call.kwargs.items()}
        )
        node.meta["tensor"] = _spec(result)
        if not isinstance(result, (tuple, list)):
            return [(node, result)]
        outs = []
        for i, value in enumerate(result):
            if value is not None:  # an output the op's mask did not ask for
                item = graph.call_function(operator.getitem, (node, i))
                item.meta["tensor"] = TensorSpec.of(value)
                outs.append((item, value))
        return outs

    return _program(case.op, build, inputs)


def _symbolic_program(case: Case, call: Call, inputs: list) -> Program:
    x, *rest = call.args
    size = opset_table()["aten.sym_size.int"].overload

    def build(graph, lift):
        node = lift(x)
        if case.op == "aten.sym_size.int":
            n = graph.call_function(size, (node, *rest))
        else:
            a, b = (graph.call_function(size, (node, dim)) for dim in (0, 1))
            n = graph.call_function(opset_table()[case.op].overload, (a, b))
        out = graph.call_function(aten.full.default, ([n, 2], 1.0))
        value = torch.ones(_symbolic_value(case, call), 2)
        out.meta["tensor"] = TensorSpec.of(value)
        return [(out, value)]

    return _program(case.op, build, inputs)


def _symbolic_value(case: Case, call: Call) -> int:
    x, *rest = call.args
    if case.op == "aten.sym_size.int":
        return x.shape[rest[0]]
    return opset_table()[case.op].overload(x.shape[0], x.shape[1])


def _flat(result) -> list:
    if isinstance(result, (tuple, list)):
        return [r for r in result if r is not None]
    return [result]


def _assert_match(case: Case, got, want) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{TensorSpec.of(got)} vs {TensorSpec.of(want)}"
    )
    if case.meta_only:
        return
    if case.op in EXACT or not want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    rtol, atol = case.tol if case.tol and want.dtype == F32 else TOLERANCES[want.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)


def _params():
    for case in CASES:
        for dtype in case.dtypes:
            name = f"{case.op}-{case.label}-{str(dtype).removeprefix('torch.')}".replace("--", "-")
            yield pytest.param(case, dtype, id=name)


@pytest.mark.parametrize(("case", "dtype"), list(_params()))
def test_rule_matches_eager_torch(case: Case, dtype):
    torch.manual_seed(0)
    call = case.make(dtype)
    inputs: list[torch.Tensor] = []
    if case.op in {c.op for c in _SYMBOLIC}:
        program = _symbolic_program(case, call, inputs)
        want = [portable.compile(program, backend="cpu")(*inputs)]
    else:
        result = opset_table()[case.op].overload(*call.args, **call.kwargs)
        program = _op_program(case, call, result, inputs)
        want = _flat(result)
    backend = XlaBackend()
    lowered = backend.lower(program, Target("xla"))
    if F64 not in {v.dtype for v in (*inputs, *want)}:
        # the rules are shared with neuron, which has no float64: none may appear on its own
        assert "f64" not in lowered.texts["graph.stablehlo.mlir"]
    got = backend.executable(backend.compile(lowered))(*inputs)
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _assert_match(case, g, w)


# --------------------------------------------------------------------------- coverage and claims


def test_table_and_exclusions_are_the_whole_opset():
    covered = {c.op for c in CASES}
    opset = set(opset_table())
    assert not covered & set(EXCLUDED), "an op is both tested and excluded"
    assert covered | set(EXCLUDED) == opset, (
        f"ops without a case: {sorted(opset - covered - set(EXCLUDED))}"
    )


def test_every_op_has_a_rule_except_the_excluded():
    rules = load_rules()
    assert rules.names("xla") == set(opset_table()) - set(EXCLUDED)
    assert rules.names("neuron") >= rules.names("xla")  # neuron shares the generic rules


def test_capabilities_are_what_the_table_runs():
    # every case above runs and passes through the xla backend's lower/compile/run, so the
    # declared ops must be exactly the table's ops: no claim without a case, no case unclaimed
    assert XlaBackend().capabilities().ops == frozenset(c.op for c in CASES)


def test_mx_arguments_are_refused_with_the_op_backend_and_fix():
    x = torch.randn(4, 48)  # 48 along axis 1 is not a multiple of the block size 32
    with FakeTensorMode() as mode:
        codes, scales = torch.ops.portable.mx_quantize(mode.from_tensor(x), "e4m3", 1)
    inputs: list = []
    case = Case("portable.mx_quantize.default", lambda d: A(x, "e4m3", 1))
    program = _op_program(case, case.make(F32), (codes, scales), inputs)
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    message = str(info.value)
    assert info.value.backend == "xla" and "portable.mx_quantize.default" in message
    assert "48 is not a multiple of 32" in message and "fix: pad dim 1" in message


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("all_reduce", ("sum", "dp", 2)),
        ("all_gather", (0, "tp", 2)),
        ("reduce_scatter", ("sum", 0, "tp", 2)),
        ("all_to_all", (0, 1, "ep", 2)),
    ],
)
def test_multi_rank_collectives_need_the_spmd_pass(op, args):
    x = torch.randn(4, 6)
    with FakeTensorMode() as mode:
        fake = getattr(torch.ops.portable, op)(mode.from_tensor(x), *args)
    result = torch.empty(fake.shape, dtype=fake.dtype)
    case = Case(f"portable.{op}.default", lambda d: A(x, *args))
    inputs: list = []
    program = _op_program(case, case.make(F32), result, inputs)
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    message = str(info.value)
    assert f"{op} over mesh axis" in message and "group_size 2" in message
    assert "spmd-partition" in message


def test_boolean_mask_indexing_is_refused_with_a_fix():
    x, mask = torch.randn(4, 5), torch.randn(4, 5) > 0
    case = Case("aten.index.Tensor", lambda d: A(x, [mask]))
    inputs: list = []
    program = _op_program(case, case.make(F32), aten.index.Tensor(x, [mask]), inputs)
    with pytest.raises(portable.LoweringError) as info:
        portable.compile(program, backend="xla")
    assert "data-dependent shape" in str(info.value) and "torch.where" in str(info.value)


@pytest.mark.parametrize("op", ["_softmax", "_log_softmax"])
def test_half_to_float_softmax_returns_float32(op):
    # torch's CPU kernels refuse half_to_float (a CUDA fast path), so the reference is its meaning:
    # the softmax of the float32 upcast input, returned in float32
    x = t(BF16, 3, 5) * 3
    want = getattr(torch, op.lstrip("_"))(x.float(), -1)
    case = Case(f"aten.{op}.default", lambda d: A(x, -1, True))
    inputs: list = []
    program = _op_program(case, case.make(BF16), want, inputs)
    got = portable.compile(program, backend="xla")(*inputs)
    assert got.dtype == F32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
