"""The opset table: every op a portable program may contain, declared as data.

Each entry: `name` (the torch op overload, `aten.add.Tensor` / `portable.attention`), `dtypes` (the
input dtype class it accepts), `shape` (its shape rule, by name; the verifier evaluates it with the
op's fake kernel), and one line of `semantics`. The signature is the op's registered schema. The
core ATen families are here, the `portable::` ops' entries in portable_entries.py, later ATen
families in `families/`. `docs/opset.md` is generated from this table (`python -m
portable.opset.docs`).

Versioning: OPSET_VERSION is `MAJOR.MINOR`. Adding ops bumps MINOR; changing or removing one bumps
MAJOR. Archives record the version they were written with; a reader accepts any MINOR of its MAJOR
that is not newer than its own.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import collectives, mx_ops, nn_ops  # noqa: F401 (define the portable:: ops the table names)
from .entry import (  # noqa: F401 (re-exported: passes import trait names from here)
    _SYMBOLIC_NAMES,
    _SYMBOLIC_TARGETS,
    ANY,
    CAST,
    COLLECTIVE,
    ELEMENTWISE,
    FLOAT,
    IDENTITY,
    INTEGER,
    MATMUL,
    NUMERIC,
    PERMUTE,
    REDUCTION,
    RESHAPE,
    SHAPE_PRODUCING,
    SHAPE_RULES,
    UINT8,
    UNIT_DIM,
    VIEW,
    OpDef,
)
from .entry import entry as _e
from .families import FAMILIES
from .portable_entries import PORTABLE

OPSET_VERSION = "1.5"

_ATEN: tuple[OpDef, ...] = (
    # elementwise arithmetic
    _e("aten.add.Tensor", NUMERIC, "broadcast", "x + alpha * y"),
    _e("aten.add.Scalar", NUMERIC, "same", "x + alpha * scalar"),
    _e("aten.sub.Tensor", NUMERIC, "broadcast", "x - alpha * y"),
    _e("aten.sub.Scalar", NUMERIC, "same", "x - alpha * scalar"),
    _e("aten.rsub.Scalar", NUMERIC, "same", "scalar - alpha * x"),
    _e("aten.mul.Tensor", ANY, "broadcast", "x * y"),
    _e("aten.mul.Scalar", NUMERIC, "same", "x * scalar"),
    _e("aten.div.Tensor", NUMERIC, "broadcast", "x / y (true division)"),
    _e(
        "aten.div.Tensor_mode",
        NUMERIC,
        "broadcast",
        "x / y rounded by rounding_mode (trunc or floor)",
    ),
    _e("aten.div.Scalar", NUMERIC, "same", "x / scalar"),
    _e("aten.neg.default", NUMERIC, "same", "-x"),
    _e("aten.abs.default", NUMERIC, "same", "|x|"),
    _e("aten.pow.Tensor_Scalar", NUMERIC, "same", "x ** exponent"),
    _e("aten.pow.Tensor_Tensor", NUMERIC, "broadcast", "x ** y"),
    _e("aten.pow.Scalar", NUMERIC, "same", "scalar ** x"),
    _e("aten.sqrt.default", FLOAT, "same", "square root"),
    _e("aten.rsqrt.default", FLOAT, "same", "1 / sqrt(x)"),
    _e("aten.exp.default", FLOAT, "same", "e ** x"),
    _e("aten.log.default", FLOAT, "same", "natural logarithm"),
    _e("aten.tanh.default", FLOAT, "same", "hyperbolic tangent"),
    _e("aten.sigmoid.default", FLOAT, "same", "1 / (1 + exp(-x))"),
    _e("aten.sin.default", FLOAT, "same", "sine"),
    _e("aten.cos.default", FLOAT, "same", "cosine"),
    _e("aten.erf.default", FLOAT, "same", "Gauss error function"),
    _e("aten.reciprocal.default", FLOAT, "same", "1 / x"),
    _e("aten.lerp.Scalar", FLOAT, "broadcast", "x + w * (y - x) (one rounding, as ATen's kernel)"),
    _e("aten.addcmul.default", NUMERIC, "broadcast", "x + value * t1 * t2"),
    _e("aten.maximum.default", NUMERIC, "broadcast", "elementwise max (NaN propagates)"),
    _e("aten.minimum.default", NUMERIC, "broadcast", "elementwise min (NaN propagates)"),
    _e("aten.clamp.default", NUMERIC, "same", "min(max(x, lo), hi)"),
    _e("aten.clamp_min.default", NUMERIC, "same", "max(x, lo)"),
    _e("aten.clamp_max.default", NUMERIC, "same", "min(x, hi)"),
    _e("aten.relu.default", NUMERIC, "same", "max(x, 0)"),
    _e("aten.gelu.default", FLOAT, "same", "x * Phi(x) (approximate='none') or its tanh form"),
    _e("aten.gelu_backward.default", FLOAT, "broadcast", "d gelu(x) / dx * grad"),
    _e("aten.silu.default", FLOAT, "same", "x * sigmoid(x)"),
    _e(
        "aten.silu_backward.default",
        FLOAT,
        "broadcast",
        "grad * sigmoid(x) * (1 + x * (1 - sigmoid(x)))",
    ),
    _e("aten.threshold_backward.default", NUMERIC, "broadcast", "grad where x > threshold else 0"),
    _e("aten.tanh_backward.default", FLOAT, "broadcast", "grad * (1 - y^2)"),
    _e("aten.sigmoid_backward.default", FLOAT, "broadcast", "grad * y * (1 - y)"),
    _e("aten.where.self", ANY, "broadcast", "cond ? x : y"),
    _e("aten.bitwise_not.default", ANY, "same", "logical / bitwise not"),
    _e("aten.bitwise_and.Tensor", ANY, "broadcast", "logical / bitwise and"),
    _e("aten.bitwise_or.Tensor", ANY, "broadcast", "logical / bitwise or"),
    _e("aten.logical_not.default", ANY, "same", "not x (bool result)"),
    _e("aten.logical_and.default", ANY, "broadcast", "x and y (bool result)"),
    _e("aten.logical_or.default", ANY, "broadcast", "x or y (bool result)"),
    # elementwise math: rounding, logarithms, inverse trigonometry, special functions
    _e("aten.sign.default", NUMERIC, "same", "sign of x: -1, 0 or 1 (0 for NaN)"),
    _e("aten.log1p.default", FLOAT, "same", "log(1 + x), accurate near 0"),
    _e("aten.expm1.default", FLOAT, "same", "exp(x) - 1, accurate near 0"),
    _e("aten.log2.default", FLOAT, "same", "base-2 logarithm"),
    _e("aten.log10.default", FLOAT, "same", "base-10 logarithm"),
    _e("aten.floor.default", NUMERIC, "same", "round toward -inf (identity on integers)"),
    _e("aten.ceil.default", NUMERIC, "same", "round toward +inf (identity on integers)"),
    _e("aten.trunc.default", NUMERIC, "same", "round toward 0 (identity on integers)"),
    _e("aten.round.default", NUMERIC, "same", "round half to even (identity on integers)"),
    _e(
        "aten.round.decimals",
        NUMERIC,
        "same",
        "round half to even at `decimals` decimal digits: nearbyint(x * 10^d) / 10^d",
    ),
    _e("aten.isinf.default", ANY, "same", "x is +inf or -inf (bool)"),
    _e("aten.asin.default", FLOAT, "same", "inverse sine (NaN outside [-1, 1])"),
    _e("aten.acos.default", FLOAT, "same", "inverse cosine (NaN outside [-1, 1])"),
    _e("aten.atan.default", FLOAT, "same", "inverse tangent"),
    _e("aten.atan2.default", FLOAT, "broadcast", "angle of the point (other, self), IEEE"),
    _e("aten.sinh.default", FLOAT, "same", "hyperbolic sine"),
    _e("aten.cosh.default", FLOAT, "same", "hyperbolic cosine"),
    _e("aten.tan.default", FLOAT, "same", "tangent"),
    _e("aten.asinh.default", FLOAT, "same", "inverse hyperbolic sine"),
    _e("aten.acosh.default", FLOAT, "same", "inverse hyperbolic cosine (NaN below 1)"),
    _e("aten.atanh.default", FLOAT, "same", "inverse hyperbolic tangent (+-inf at +-1)"),
    _e("aten.erfc.default", FLOAT, "same", "1 - erf(x), accurate in the tail"),
    _e("aten.erfinv.default", FLOAT, "same", "inverse error function (+-inf at +-1)"),
    _e("aten.lgamma.default", FLOAT, "same", "log |gamma(x)| (+inf at the poles 0, -1, -2, ...)"),
    _e(
        "aten.digamma.default",
        FLOAT,
        "same",
        "d lgamma(x) / dx (-inf at +0, +inf at -0, NaN at negative integers)",
    ),
    _e("aten.exp2.default", FLOAT, "same", "2 ** x"),
    _e("aten.hypot.default", FLOAT, "broadcast", "sqrt(x^2 + y^2) without overflow"),
    _e(
        "aten.remainder.Tensor",
        NUMERIC,
        "broadcast",
        "x mod y with the sign of y (Python's %): fmod(x, y), plus y where the signs differ",
    ),
    _e("aten.remainder.Scalar", NUMERIC, "same", "x mod scalar with the sign of the scalar"),
    _e("aten.fmod.Tensor", NUMERIC, "broadcast", "x mod y with the sign of x (C's fmod)"),
    _e("aten.fmod.Scalar", NUMERIC, "same", "x mod scalar with the sign of x (C's fmod)"),
    _e(
        "aten.elu.default",
        FLOAT,
        "same",
        "x >= 0 ? x * scale : expm1(x * input_scale) * alpha * scale",
    ),
    _e("aten.leaky_relu.default", FLOAT, "same", "x > 0 ? x : x * negative_slope"),
    _e("aten.hardtanh.default", NUMERIC, "same", "min(max(x, min_val), max_val) (NaN propagates)"),
    _e(
        "aten.clamp.Tensor",
        NUMERIC,
        "broadcast",
        "min(max(x, lo), hi) with tensor bounds (NaN in any operand propagates)",
    ),
    _e("aten.bitwise_xor.Tensor", ANY, "broadcast", "logical / bitwise exclusive or"),
    _e(
        "aten.bitwise_left_shift.Tensor",
        INTEGER,
        "broadcast",
        "x << y; 0 where y < 0 or y >= the bit width (torch's kernel)",
    ),
    _e(
        "aten.bitwise_right_shift.Tensor",
        INTEGER,
        "broadcast",
        "x >> y, arithmetic; the sign (0 or -1) where y < 0 or y >= the bit width",
    ),
    _e("aten.gcd.default", INTEGER, "broadcast", "greatest common divisor, >= 0; gcd(0, 0) = 0"),
    _e("aten.lcm.default", INTEGER, "broadcast", "|x / gcd(x, y) * y|; 0 where gcd is 0"),
    _e("aten.logical_xor.default", ANY, "broadcast", "x xor y, nonzero as true (bool result)"),
    _e("aten.copysign.Tensor", FLOAT, "broadcast", "|x| with the sign bit of y"),
    # comparisons
    _e("aten.eq.Scalar", ANY, "same", "x == scalar"),
    _e("aten.eq.Tensor", ANY, "broadcast", "x == y"),
    _e("aten.ne.Scalar", ANY, "same", "x != scalar"),
    _e("aten.ne.Tensor", ANY, "broadcast", "x != y"),
    _e("aten.lt.Scalar", NUMERIC, "same", "x < scalar"),
    _e("aten.lt.Tensor", NUMERIC, "broadcast", "x < y"),
    _e("aten.le.Scalar", NUMERIC, "same", "x <= scalar"),
    _e("aten.le.Tensor", NUMERIC, "broadcast", "x <= y"),
    _e("aten.gt.Scalar", NUMERIC, "same", "x > scalar"),
    _e("aten.gt.Tensor", NUMERIC, "broadcast", "x > y"),
    _e("aten.ge.Scalar", NUMERIC, "same", "x >= scalar"),
    _e("aten.ge.Tensor", NUMERIC, "broadcast", "x >= y"),
    _e("aten.isnan.default", ANY, "same", "x != x"),
    # reductions
    _e("aten.sum.dim_IntList", ANY, "reduce", "sum over dims"),
    _e("aten.sum.default", ANY, "reduce", "sum of all elements"),
    _e("aten.mean.dim", FLOAT, "reduce", "mean over dims"),
    _e("aten.mean.default", FLOAT, "reduce", "mean of all elements"),
    _e("aten.amax.default", NUMERIC, "reduce", "max over dims"),
    _e("aten.amin.default", NUMERIC, "reduce", "min over dims"),
    _e("aten.max.dim", ANY, "tuple", "(max, argmax) over one dim"),
    _e("aten.argmax.default", NUMERIC, "reduce", "index of the max over one dim"),
    _e("aten.argmin.default", NUMERIC, "reduce", "index of the min over one dim (first of ties)"),
    _e("aten.min.dim", ANY, "tuple", "(min, argmin) over one dim"),
    _e("aten.max.default", ANY, "reduce", "max of all elements (NaN propagates)"),
    _e("aten.min.default", ANY, "reduce", "min of all elements (NaN propagates)"),
    _e("aten.any.default", ANY, "reduce", "whether any element is nonzero"),
    _e("aten.any.dim", ANY, "reduce", "whether any element is nonzero, over one dim"),
    _e("aten.any.dims", ANY, "reduce", "whether any element is nonzero, over dims ([]: none)"),
    _e("aten.prod.default", ANY, "reduce", "product of all elements"),
    _e("aten.prod.dim_int", ANY, "reduce", "product over one dim"),
    _e("aten.var_mean.correction", FLOAT, "tuple", "(variance with a correction, mean) over dims"),
    _e(
        "aten.linalg_vector_norm.default",
        FLOAT,
        "reduce",
        "sum(|x|^ord)^(1/ord) over dims; ord inf / -inf: max / min |x|, 0: count of nonzeros",
    ),
    _e("aten.var.correction", FLOAT, "reduce", "variance over dims with a correction"),
    _e("aten.topk.default", NUMERIC, "tuple", "(values, indices) of the k largest along dim"),
    _e("aten.cumsum.default", ANY, "same", "inclusive prefix sum along dim"),
    # sorting, selection and scans
    _e("aten.flip.default", ANY, "same", "reverse the order of elements along `dims`"),
    _e("aten.sort.default", ANY, "tuple", "(values, indices) sorted along dim; NaN largest"),
    _e(
        "aten.sort.stable",
        ANY,
        "tuple",
        "(values, indices) sorted along dim, ties in index order when stable; NaN largest",
    ),
    _e("aten.cumprod.default", ANY, "same", "inclusive prefix product along dim"),
    _e(
        "aten.scatter_reduce.two",
        ANY,
        "same",
        "x with src reduced into x[index] along dim by sum/prod/mean/amax/amin (with x or not)",
    ),
    # softmax family
    _e("aten._softmax.default", FLOAT, "same", "exp(x - max) / sum(exp(x - max)) along dim"),
    _e("aten._log_softmax.default", FLOAT, "same", "x - max - log(sum(exp(x - max))) along dim"),
    _e("aten._softmax_backward_data.default", FLOAT, "same", "y * (g - sum(g * y)) along dim"),
    _e("aten._log_softmax_backward_data.default", FLOAT, "same", "g - exp(y) * sum(g) along dim"),
    # losses (kept whole: their decompositions round differently from the eager kernels)
    _e("aten.mse_loss.default", FLOAT, "reduce", "mean/sum/none of (x - y)^2 by reduction"),
    _e("aten.mse_loss_backward.default", FLOAT, "same", "grad * 2 * (x - y) / n (mean reduction)"),
    _e(
        "aten.nll_loss_forward.default",
        FLOAT,
        "tuple",
        "(-sum of x[i, target[i]] weighted and reduced, total weight)",
    ),
    _e(
        "aten.nll_loss_backward.default",
        FLOAT,
        "same",
        "scatter -grad / total weight to the target entries",
    ),
    # linear algebra
    _e("aten.mm.default", NUMERIC, "matmul", "[m, k] @ [k, n]"),
    _e("aten.bmm.default", NUMERIC, "matmul", "[b, m, k] @ [b, k, n]"),
    _e("aten.addmm.default", NUMERIC, "matmul", "beta * bias + alpha * (x @ w)"),
    # shape and layout
    _e("aten.view.default", ANY, "view", "reinterpret with a new shape (contiguous semantics)"),
    _e("aten._unsafe_view.default", ANY, "view", "as view, no aliasing guarantee"),
    _e("aten.reshape.default", ANY, "view", "new shape with the same elements in row-major order"),
    _e("aten.permute.default", ANY, "view", "reorder dims"),
    _e("aten.transpose.int", ANY, "view", "swap two dims"),
    _e("aten.t.default", ANY, "view", "transpose a 2-D tensor"),
    _e("aten.unsqueeze.default", ANY, "view", "insert a size-1 dim"),
    _e("aten.squeeze.dims", ANY, "view", "remove the given size-1 dims"),
    _e("aten.squeeze.dim", ANY, "view", "remove a size-1 dim"),
    _e("aten.expand.default", ANY, "view", "broadcast to a larger shape"),
    _e("aten.clone.default", ANY, "same", "copy"),
    _e("aten.alias.default", ANY, "same", "identity"),
    _e("aten._to_copy.default", ANY, "same", "copy with a new dtype (round to nearest even)"),
    _e("aten.cat.default", ANY, "concat", "concatenate along dim"),
    _e("aten.stack.default", ANY, "concat", "stack along a new dim"),
    _e("aten.split_with_sizes.default", ANY, "tuple", "split along dim into the given sizes"),
    _e("aten.slice.Tensor", ANY, "index", "x[start:end:step] along dim"),
    _e(
        "aten.slice_scatter.default",
        ANY,
        "same",
        "x with x[start:end:step] along dim replaced by src",
    ),
    _e("aten.select.int", ANY, "index", "x[index] along dim, dim removed"),
    _e("aten.select_scatter.default", ANY, "same", "x with x[index] along dim replaced by src"),
    _e("aten.index.Tensor", ANY, "index", "advanced indexing by index tensors"),
    _e("aten.index_put.default", ANY, "same", "x with x[indices] = (or +=) values"),
    _e("aten.index_select.default", ANY, "index", "gather whole slices along dim"),
    _e("aten.gather.default", ANY, "index", "out[i][j] = x[i][index[i][j]] along dim"),
    _e("aten.scatter.src", ANY, "same", "x with x[index] = src along dim"),
    _e("aten.scatter.value", ANY, "same", "x with x[index] = value along dim"),
    _e("aten.scatter_add.default", NUMERIC, "same", "x with x[index] += src along dim"),
    _e("aten.embedding.default", ANY, "index", "weight[indices]"),
    _e(
        "aten.embedding_dense_backward.default",
        FLOAT,
        "index",
        "scatter-add grad rows into a zero weight",
    ),
    _e("aten.constant_pad_nd.default", ANY, "view", "pad with a constant"),
    _e("aten.tril.default", ANY, "same", "zero above the diagonal"),
    _e("aten.triu.default", ANY, "same", "zero below the diagonal"),
    # dynamic shapes
    _e(
        "aten.sym_size.int",
        ANY,
        "scalar",
        "the size of dim `dim` of x, symbolic when the dim is dynamic",
    ),
    _e("sym.add", ANY, "scalar", "a + b on sizes"),
    _e("sym.sub", ANY, "scalar", "a - b on sizes"),
    _e("sym.mul", ANY, "scalar", "a * b on sizes"),
    _e("sym.floordiv", ANY, "scalar", "a // b on sizes"),
    _e("sym.mod", ANY, "scalar", "a % b on sizes"),
    # creation
    _e("aten.full.default", ANY, "creation", "tensor of one value"),
    _e("aten.full_like.default", ANY, "same", "tensor of one value, shaped like x"),
    _e("aten.zeros_like.default", ANY, "same", "zeros shaped like x"),
    _e("aten.ones_like.default", ANY, "same", "ones shaped like x"),
    _e("aten.empty.memory_format", ANY, "creation", "uninitialised tensor (always overwritten)"),
    _e(
        "aten.empty_permuted.default",
        ANY,
        "creation",
        "uninitialised tensor with a dim order (always overwritten)",
    ),
    _e("aten.arange.start_step", ANY, "creation", "start, start+step, ... < end"),
    _e("aten.scalar_tensor.default", ANY, "creation", "0-d tensor of a value"),
    _e("aten.lift_fresh_copy.default", ANY, "same", "copy of a constant"),
    # convolution, pooling, batch norm
    _e(
        "aten.convolution.default",
        NUMERIC,
        "conv",
        "N-d convolution with stride, padding, dilation, groups (integers wrap, as torch's)",
    ),
    _e(
        "aten.convolution_backward.default",
        FLOAT,
        "tuple",
        "(grad_input, grad_weight, grad_bias) of convolution",
    ),
    _e("aten.max_pool2d_with_indices.default", NUMERIC, "pool", "(max, argmax) over 2-d windows"),
    _e(
        "aten.max_pool2d_with_indices_backward.default",
        FLOAT,
        "same",
        "route grad to each window's argmax",
    ),
    _e("aten.avg_pool2d.default", NUMERIC, "pool", "mean over 2-d windows (integers truncate)"),
    _e("aten.avg_pool2d_backward.default", FLOAT, "same", "spread grad evenly over each window"),
    _e("aten._adaptive_avg_pool2d.default", FLOAT, "pool", "mean over adaptive 2-d windows"),
    _e(
        "aten._adaptive_avg_pool2d_backward.default",
        FLOAT,
        "same",
        "backward of adaptive average pooling",
    ),
    _e(
        "aten._native_batch_norm_legit_no_training.default",
        FLOAT,
        "tuple",
        "batch norm with running statistics",
    ),
    _e(
        "aten._native_batch_norm_legit_functional.default",
        FLOAT,
        "tuple",
        "batch norm with batch statistics; returns updated running stats",
    ),
    _e(
        "aten.native_batch_norm_backward.default",
        FLOAT,
        "tuple",
        "(grad_input, grad_weight, grad_bias) of batch norm",
    ),
    _e("aten.native_layer_norm.default", FLOAT, "tuple", "(y, mean, rstd) of layer norm"),
    _e(
        "aten.native_layer_norm_backward.default",
        FLOAT,
        "tuple",
        "(grad_input, grad_weight, grad_bias) of layer norm",
    ),
    # group norm, interpolation, adaptive max and 3-d pooling
    _e(
        "aten.native_group_norm.default",
        FLOAT,
        "tuple",
        "(y, mean, rstd) of group norm: C split into `group` groups, each normalized over its "
        "channels and HxW; mean and rstd are [N, group]",
    ),
    _e(
        "aten.upsample_bilinear2d.vec",
        FLOAT,
        "pool",
        "bilinear resize of the last two dims to output_size or by scale_factors (align_corners "
        "maps corner to corner; else half-pixel centres, the given scale used when passed)",
    ),
    _e(
        "aten.upsample_nearest2d.vec",
        FLOAT,
        "pool",
        "nearest resize of the last two dims: source index floor(dst * in / out), or "
        "floor(dst / scale) with scale_factors, rounded as torch's CPU kernels round it",
    ),
    _e(
        "aten.upsample_nearest2d.default",
        FLOAT,
        "pool",
        "upsample_nearest2d.vec with the output size given and optional scales_h, scales_w",
    ),
    _e(
        "aten.adaptive_max_pool2d.default",
        FLOAT,
        "tuple",
        "(max, argmax h * W + w) over adaptive 2-d windows [floor(i*n/o), ceil((i+1)*n/o))",
    ),
    _e(
        "aten.adaptive_max_pool2d_backward.default",
        FLOAT,
        "same",
        "route grad to each adaptive window's argmax",
    ),
    _e(
        "aten.max_pool3d_with_indices.default",
        NUMERIC,
        "tuple",
        "(max, argmax d * H * W + h * W + w) over 3-d windows",
    ),
    _e(
        "aten.max_pool3d_with_indices_backward.default",
        FLOAT,
        "same",
        "route grad to each 3-d window's argmax",
    ),
    _e("aten.avg_pool3d.default", NUMERIC, "pool", "mean over 3-d windows (integers truncate)"),
    _e(
        "aten.avg_pool3d_backward.default", FLOAT, "same", "spread grad evenly over each 3-d window"
    ),
    _e("aten._adaptive_avg_pool3d.default", FLOAT, "pool", "mean over adaptive 3-d windows"),
    _e(
        "aten._adaptive_avg_pool3d_backward.default",
        FLOAT,
        "same",
        "backward of adaptive 3-d average pooling",
    ),
    _e(
        "aten.diagonal.default",
        ANY,
        "view",
        "the diagonal at `offset` of the (dim1, dim2) planes, moved to a new last dim",
    ),
    _e(
        "aten.diagonal_scatter.default",
        ANY,
        "same",
        "x with its diagonal at `offset` of the (dim1, dim2) planes replaced by src",
    ),
    _e("aten.repeat.default", ANY, "view", "tile x `repeats` times along each dim"),
)


def _section(entries: tuple[OpDef, ...], first: str, last: str) -> tuple[str, ...]:
    names = [e.name for e in entries]
    return tuple(names[names.index(first) : names.index(last) + 1])


# trait -> the ops that carry it. ELEMENTWISE is the "elementwise arithmetic" and "comparisons"
# sections of _ATEN, REDUCTION its "reductions" section, each with what the families declare
# (`family.TRAITS`); the tests check each trait against its semantics.
TRAITS: dict[str, tuple[str, ...]] = {
    RESHAPE: ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"),
    PERMUTE: ("aten.permute.default", "aten.transpose.int", "aten.t.default"),
    UNIT_DIM: ("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims"),
    VIEW: (
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.permute.default",
        "aten.transpose.int",
        "aten.t.default",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.expand.default",
        "aten.alias.default",
        "aten.slice.Tensor",
        "aten.select.int",
    ),
    IDENTITY: ("aten.clone.default", "aten.alias.default"),
    CAST: ("aten._to_copy.default",),
    ELEMENTWISE: (
        *_section(_ATEN, "aten.add.Tensor", "aten.isnan.default"),
        *(name for family in FAMILIES for name in family.TRAITS.get(ELEMENTWISE, ())),
    ),
    REDUCTION: (
        *_section(_ATEN, "aten.sum.dim_IntList", "aten.var.correction"),
        *(name for family in FAMILIES for name in family.TRAITS.get(REDUCTION, ())),
    ),
    COLLECTIVE: (
        "portable.all_reduce.default",
        "portable.all_gather.default",
        "portable.reduce_scatter.default",
        "portable.all_to_all.default",
        "portable.local_shard.default",
    ),
    SHAPE_PRODUCING: (
        "aten.sym_size.int",
        *(name for name in _SYMBOLIC_TARGETS),
    ),
    MATMUL: ("aten.mm.default", "aten.bmm.default", "aten.addmm.default"),
}


def _with_traits(entries: tuple[OpDef, ...]) -> dict[str, OpDef]:
    table: dict[str, OpDef] = {}
    for entry in entries:
        if entry.name in table:
            raise ValueError(f"opset entry {entry.name} is declared twice")
        if entry.shape not in SHAPE_RULES:
            raise ValueError(f"opset entry {entry.name} has unknown shape rule {entry.shape}")
        table[entry.name] = entry
    for trait, names in TRAITS.items():
        for name in names:
            if name not in table:
                raise ValueError(f"trait {trait} names {name}, which is not in the opset")
            entry = table[name]
            table[name] = dataclasses.replace(entry, traits=entry.traits | {trait})
    return table


@functools.cache
def opset_table() -> dict[str, OpDef]:
    """name -> OpDef for every op in the opset (the portable:: ops are defined on import)."""
    return _with_traits((*_ATEN, *(e for family in FAMILIES for e in family.ENTRIES), *PORTABLE))


@functools.cache
def ops_with(*traits: str) -> frozenset:
    """The node targets (op overloads, or Python operators for `sym.*`) of every op carrying
    any of `traits`; a KeyError names an unknown trait."""
    unknown = [t for t in traits if t not in TRAITS]
    if unknown:
        raise KeyError(f"unknown op trait {unknown[0]!r}; traits: {', '.join(TRAITS)}")
    table = opset_table()
    return frozenset(table[name].overload for t in traits for name in TRAITS[t])


def has_trait(target: object, trait: str) -> bool:
    """Whether the op a node target names carries `trait` (False for targets outside the opset)."""
    return target in ops_with(trait)


def op_name(target: object) -> str:
    """`aten.add.Tensor` for torch.ops.aten.add.Tensor, `sym.mul` for operator.mul on sizes; the
    qualified name for other callables."""
    if target in _SYMBOLIC_NAMES:
        return _SYMBOLIC_NAMES[target]
    if isinstance(target, torch._ops.OpOverload):
        ns, rest = target.name().split("::", 1)
        op, _, overload = rest.partition(".")
        return f"{ns}.{op}.{overload or 'default'}"
    return getattr(target, "__qualname__", None) or str(target)


def lookup(target: object) -> OpDef | None:
    """The opset entry for a node target, or None if the op is not in the opset."""
    if target in _SYMBOLIC_NAMES:
        return opset_table()[_SYMBOLIC_NAMES[target]]
    if not isinstance(target, torch._ops.OpOverload):
        return None
    return opset_table().get(op_name(target))


def resolve(name: str) -> torch._ops.OpOverload:
    """The torch op overload for an opset name; KeyError if not in the opset."""
    return opset_table()[name].overload
