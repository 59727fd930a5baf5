"""Elementwise arithmetic, comparisons, activations and their backward ops.

Torch computes arithmetic in the result dtype (recorded on the node); operands are cast to it
first, so int tensors times float scalars, and bool masks, behave as in PyTorch. Half-precision
kernels compute in float32 and round once (`opmath`), which composite rules (gelu, silu, their
backward ops, lerp, addcmul) follow so that bfloat16 results round like torch's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import RULES
from ._util import as_array, opmath, opmath_unary, out_dtype, torch_result_dtype


def _binary(fn):
    def rule(ctx, x, y, *, alpha=1):
        dtype = out_dtype(ctx)
        compute = opmath(dtype)
        a, b = as_array(x, compute), as_array(y, compute)
        if alpha != 1:
            b = b * as_array(alpha, compute)
        return fn(a, b).astype(dtype)

    return rule


RULES.register("aten.add.Tensor", "aten.add.Scalar")(_binary(jnp.add))
RULES.register("aten.sub.Tensor", "aten.sub.Scalar")(_binary(jnp.subtract))


@RULES.register("aten.rsub.Scalar")
def rsub(ctx, x, other, alpha=1):
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    y = as_array(other, compute) - as_array(x, compute) * as_array(alpha, compute)
    return y.astype(dtype)


RULES.register("aten.mul.Tensor", "aten.mul.Scalar")(_binary(jnp.multiply))
RULES.register("aten.div.Tensor", "aten.div.Scalar")(_binary(jnp.divide))
RULES.register("aten.maximum.default")(_binary(jnp.maximum))
RULES.register("aten.minimum.default")(_binary(jnp.minimum))


@RULES.register("aten.div.Tensor_mode")
def div_mode(ctx, x, y, *, rounding_mode=None):
    dtype = out_dtype(ctx)
    a, b = as_array(x, dtype), as_array(y, dtype)
    if rounding_mode is None:
        return a / b
    if jnp.issubdtype(dtype, jnp.integer):
        q = jnp.floor_divide(a, b)
        if rounding_mode == "trunc":  # floor_divide rounds toward -inf; trunc toward 0
            q = jnp.where((a % b != 0) & ((a < 0) != (b < 0)), q + 1, q)
        return q
    q = a / b
    return jnp.trunc(q) if rounding_mode == "trunc" else jnp.floor(q)


for _name, _fn in {
    "aten.neg.default": jnp.negative,
    "aten.abs.default": jnp.abs,
    "aten.sqrt.default": jnp.sqrt,
    "aten.rsqrt.default": jax.lax.rsqrt,
    "aten.exp.default": jnp.exp,
    "aten.log.default": jnp.log,
    "aten.tanh.default": jnp.tanh,
    "aten.sigmoid.default": jax.nn.sigmoid,
    "aten.sin.default": jnp.sin,
    "aten.cos.default": jnp.cos,
    "aten.erf.default": jax.scipy.special.erf,
    "aten.reciprocal.default": jnp.reciprocal,
    "aten.relu.default": jax.nn.relu,
    "aten.silu.default": lambda x: x / (1 + jnp.exp(-x)),  # torch: x / (1 + exp(-x))
}.items():
    RULES.register(_name)(opmath_unary(_fn))

# torch's pow(Tensor, Scalar) kernel special-cases these float exponents (exact forms, not exp/log)
_POW_SPECIAL = {
    1: lambda x: x,
    2: lambda x: x * x,
    3: lambda x: x * x * x,
    0.5: jnp.sqrt,
    -0.5: jax.lax.rsqrt,
    -1: lambda x: 1 / x,
    -2: lambda x: 1 / (x * x),
}


@RULES.register("aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar")
def pow_(ctx, x, y):
    dtype = out_dtype(ctx)
    if isinstance(y, (int, float)) and not isinstance(y, bool):
        base = as_array(x, opmath(dtype))
        if jnp.issubdtype(dtype, jnp.integer):
            if y >= 0:
                return jax.lax.integer_pow(base, int(y))
        elif y in _POW_SPECIAL:
            return _POW_SPECIAL[y](base).astype(dtype)
    compute = opmath(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return _integer_pow(as_array(x, compute), as_array(y, compute)).astype(dtype)
    return jnp.power(as_array(x, compute), as_array(y, compute)).astype(dtype)


def _integer_pow(base, exponent):
    """torch's integer pow: binary exponentiation over every bit of the exponent, wrapping as
    its kernel does (jnp.power looks at 6 bits only: 3 ** 64 came out 1); a negative exponent
    gives 1 for base 1, +-1 for base -1 by the exponent's parity and 0 otherwise."""
    base, exponent = jnp.broadcast_arrays(base, exponent.astype(base.dtype))
    negative = exponent < 0
    remaining = jnp.where(negative, 0, exponent)
    power = jnp.ones_like(base)
    square = base
    for _ in range(jnp.iinfo(base.dtype).bits - 1):
        power = jnp.where((remaining & 1) != 0, power * square, power)
        square = square * square
        remaining = remaining >> 1
    one = jnp.ones_like(power)
    odd = (exponent % 2) != 0
    inverse = jnp.where(base == 1, one, jnp.where(base == -1, jnp.where(odd, -one, one), 0))
    return jnp.where(negative, inverse, power)


@RULES.register("aten.clamp.default")
def clamp(ctx, x, min=None, max=None):  # noqa: A002 (torch's argument names)
    dtype = out_dtype(ctx)
    x = as_array(x, dtype)
    if min is not None:
        x = jnp.maximum(x, as_array(min, dtype))
    if max is not None:
        x = jnp.minimum(x, as_array(max, dtype))
    return x


@RULES.register("aten.clamp_min.default")
def clamp_min(ctx, x, lo):
    return clamp(ctx, x, min=lo)


@RULES.register("aten.clamp_max.default")
def clamp_max(ctx, x, hi):
    return clamp(ctx, x, max=hi)


# gelu constants as ATen writes them
_SQRT1_2 = math.sqrt(0.5)
_GELU_PDF = 0.5 * (2 / math.sqrt(math.pi)) * _SQRT1_2  # 1 / sqrt(2 pi)
_GELU_TANH_BETA = math.sqrt(2) * (2 / math.sqrt(math.pi)) * 0.5  # sqrt(2 / pi)
_GELU_TANH_KAPPA = 0.044715


@RULES.register("aten.gelu.default")
def gelu(ctx, x, approximate="none"):
    dtype = out_dtype(ctx)
    x = x.astype(opmath(dtype))
    if approximate == "tanh":
        inner = _GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x * x * x)
        y = 0.5 * x * (1 + jnp.tanh(inner))
    else:
        y = x * 0.5 * (1 + jax.scipy.special.erf(x * _SQRT1_2))
    return y.astype(dtype)


@RULES.register("aten.gelu_backward.default")
def gelu_backward(ctx, grad, x, approximate="none"):
    dtype = out_dtype(ctx)
    g, x = grad.astype(opmath(dtype)), x.astype(opmath(dtype))
    if approximate == "tanh":
        x_sq = x * x
        inner = _GELU_TANH_BETA * (x + _GELU_TANH_KAPPA * x_sq * x)
        t = jnp.tanh(inner)
        left, right = 0.5 * x, 1 + t
        d_inner = _GELU_TANH_BETA * (1 + 3 * _GELU_TANH_KAPPA * x_sq)
        dx = 0.5 * right + left * (1 - t * t) * d_inner
    else:
        cdf = 0.5 * (1 + jax.scipy.special.erf(x * _SQRT1_2))
        dx = cdf + x * (jnp.exp(-0.5 * x * x) * _GELU_PDF)
    return (g * dx).astype(dtype)


@RULES.register("aten.silu_backward.default")
def silu_backward(ctx, grad, x):
    # torch: grad * s * (1 + x * (1 - s)), s = sigmoid(x)
    dtype = out_dtype(ctx)
    g, x = grad.astype(opmath(dtype)), x.astype(opmath(dtype))
    s = 1 / (1 + jnp.exp(-x))
    return (g * s * (1 + x * (1 - s))).astype(dtype)


@RULES.register("aten.threshold_backward.default")
def threshold_backward(ctx, grad, x, threshold):
    dtype = out_dtype(ctx)
    return jnp.where(x <= threshold, jnp.zeros((), dtype), grad.astype(dtype))


@RULES.register("aten.tanh_backward.default")
def tanh_backward(ctx, grad, y):
    dtype = out_dtype(ctx)
    g, y = grad.astype(opmath(dtype)), y.astype(opmath(dtype))
    return (g * (1 - y * y)).astype(dtype)


@RULES.register("aten.sigmoid_backward.default")
def sigmoid_backward(ctx, grad, y):
    dtype = out_dtype(ctx)
    g, y = grad.astype(opmath(dtype)), y.astype(opmath(dtype))
    return (g * (1 - y) * y).astype(dtype)


@RULES.register("aten.where.self")
def where(ctx, cond, x, y):
    dtype = out_dtype(ctx)
    return jnp.where(as_array(cond, jnp.bool_), as_array(x, dtype), as_array(y, dtype))


@RULES.register("aten.lerp.Scalar")
def lerp(ctx, x, end, weight):
    # torch: |w| < 0.5 ? x + w * (end - x) : end - (end - x) * (1 - w)
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    x, end, w = as_array(x, compute), as_array(end, compute), as_array(weight, compute)
    y = x + w * (end - x) if abs(weight) < 0.5 else end - (end - x) * (1 - w)
    return y.astype(dtype)


@RULES.register("aten.addcmul.default")
def addcmul(ctx, x, t1, t2, *, value=1):
    # torch: x + value * t1 * t2, evaluated left to right
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    x, a, b = as_array(x, compute), as_array(t1, compute), as_array(t2, compute)
    return (x + as_array(value, compute) * a * b).astype(dtype)


def _compare(fn):
    def rule(ctx, x, y):
        # compare in torch's promoted dtype (an int64 tensor vs 0.5 compares in float32)
        dtype = torch_result_dtype(ctx, x, y)
        return fn(as_array(x, dtype), as_array(y, dtype))

    return rule


for _names, _cmp in {
    ("aten.eq.Scalar", "aten.eq.Tensor"): jnp.equal,
    ("aten.ne.Scalar", "aten.ne.Tensor"): jnp.not_equal,
    ("aten.lt.Scalar", "aten.lt.Tensor"): jnp.less,
    ("aten.le.Scalar", "aten.le.Tensor"): jnp.less_equal,
    ("aten.gt.Scalar", "aten.gt.Tensor"): jnp.greater,
    ("aten.ge.Scalar", "aten.ge.Tensor"): jnp.greater_equal,
}.items():
    RULES.register(*_names)(_compare(_cmp))


@RULES.register("aten.isnan.default")
def isnan(ctx, x):
    return jnp.isnan(x)


@RULES.register("aten.logical_not.default")
def logical_not(ctx, x):
    return jnp.logical_not(x)


@RULES.register("aten.logical_and.default")
def logical_and(ctx, x, y):
    return jnp.logical_and(x, y)


@RULES.register("aten.logical_or.default")
def logical_or(ctx, x, y):
    return jnp.logical_or(x, y)


@RULES.register("aten.bitwise_not.default")
def bitwise_not(ctx, x):
    return jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.bitwise_not(x)


@RULES.register("aten.bitwise_and.Tensor")
def bitwise_and(ctx, x, y):
    dtype = out_dtype(ctx)
    return jnp.bitwise_and(as_array(x, dtype), as_array(y, dtype))


@RULES.register("aten.bitwise_or.Tensor")
def bitwise_or(ctx, x, y):
    dtype = out_dtype(ctx)
    return jnp.bitwise_or(as_array(x, dtype), as_array(y, dtype))
