"""Reductions, scans, top-k and the softmax family (forward and backward).

Torch conventions kept here: dims may be negative; `dim=None` or `[]` reduces every dim; sums
and products of bool/int tensors are int64 (the recorded result dtype); half-precision inputs
accumulate in float32 and round once; `max.dim`/`min.dim`/`argmax`/`argmin`/`topk` return int64
indices of the first maximum (minimum), NaN counting as both; `any.dims` with `dim=[]` reduces
no dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from . import RULES
from ._util import dim_list, norm_dim, opmath, out_dtype, reduce_mean, reduce_sum


@RULES.register("aten.sum.dim_IntList")
def sum_dim(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = out_dtype(ctx)
    return reduce_sum(x.astype(out), dim_list(dim, x.ndim), keepdim, out)


@RULES.register("aten.sum.default")
def sum_all(ctx, x, *, dtype=None):
    return sum_dim(ctx, x)


@RULES.register("aten.mean.dim")
def mean_dim(ctx, x, dim=None, keepdim=False, *, dtype=None):
    out = out_dtype(ctx)
    return reduce_mean(x.astype(out), dim_list(dim, x.ndim), keepdim, out)


@RULES.register("aten.mean.default")
def mean_all(ctx, x, *, dtype=None):
    return mean_dim(ctx, x)


@RULES.register("aten.amax.default")
def amax(ctx, x, dim=(), keepdim=False):
    return jnp.max(x, axis=dim_list(dim, x.ndim), keepdims=keepdim)


@RULES.register("aten.amin.default")
def amin(ctx, x, dim=(), keepdim=False):
    return jnp.min(x, axis=dim_list(dim, x.ndim), keepdims=keepdim)


@RULES.register("aten.max.dim")
def max_dim(ctx, x, dim, keepdim=False):
    d = norm_dim(dim, x.ndim)
    if x.ndim == 0:
        return x, jnp.zeros((), out_dtype(ctx, 1))
    # jnp.argmax returns the first maximum and treats NaN as the maximum, like torch
    index = jnp.argmax(x, axis=d, keepdims=keepdim).astype(out_dtype(ctx, 1))
    return jnp.max(x, axis=d, keepdims=keepdim), index


def _arg_extreme(find):
    """argmax / argmin: the first extreme's index (jnp's, like torch's, take NaN as the
    extreme); with dim None an index into the flattened tensor, keepdim keeping every dim."""

    def rule(ctx, x, dim=None, keepdim=False):
        dtype = out_dtype(ctx)
        if x.ndim == 0:
            return jnp.zeros((), dtype)
        if dim is None:
            index = find(x.reshape(-1)).astype(dtype)
            return index.reshape((1,) * x.ndim) if keepdim else index
        return find(x, axis=norm_dim(dim, x.ndim), keepdims=keepdim).astype(dtype)

    return rule


RULES.register("aten.argmax.default")(_arg_extreme(jnp.argmax))
RULES.register("aten.argmin.default")(_arg_extreme(jnp.argmin))


@RULES.register("aten.min.dim")
def min_dim(ctx, x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), out_dtype(ctx, 1))
    d = norm_dim(dim, x.ndim)
    index = jnp.argmin(x, axis=d, keepdims=keepdim).astype(out_dtype(ctx, 1))
    return jnp.min(x, axis=d, keepdims=keepdim), index


@RULES.register("aten.max.default")
def max_all(ctx, x):
    return jnp.max(x)


@RULES.register("aten.min.default")
def min_all(ctx, x):
    return jnp.min(x)


def _any(ctx, x, dims, keepdim):
    # nonzero is true (NaN included); the result is bool, or uint8 for a uint8 input
    return jnp.any(x != 0, axis=dims, keepdims=keepdim).astype(out_dtype(ctx))


@RULES.register("aten.any.default")
def any_all(ctx, x):
    return _any(ctx, x, None, False)


@RULES.register("aten.any.dim")
def any_dim(ctx, x, dim, keepdim=False):
    return _any(ctx, x, dim_list(dim, x.ndim), keepdim)


@RULES.register("aten.any.dims")
def any_dims(ctx, x, dim=None, keepdim=False):
    # unlike sum's, an empty dim list reduces no dim (dim=None reduces every dim)
    dims = () if isinstance(dim, (list, tuple)) and not dim else dim_list(dim, x.ndim)
    return _any(ctx, x, dims, keepdim)


def _prod(ctx, x, dims, keepdim):
    # bool and int inputs multiply in int64 (the recorded result dtype). Torch's CPU kernel
    # multiplies float16/bfloat16 in their own precision, one rounding per factor, in index order
    # (while the reduced run is short enough for its scalar loop): the chain below does the same.
    out = out_dtype(ctx)
    if opmath(out) == out:
        return jnp.prod(x.astype(out), axis=dims, keepdims=keepdim)
    rest = [d for d in range(x.ndim) if d not in dims]
    rows = jnp.transpose(x.astype(out), (*dims, *rest)).reshape(-1, *(x.shape[d] for d in rest))

    def times(i, acc):
        return (acc.astype(opmath(out)) * rows[i].astype(opmath(out))).astype(out)

    result = jax.lax.fori_loop(0, rows.shape[0], times, jnp.ones(rows.shape[1:], out))
    if keepdim:
        result = jnp.expand_dims(result, dims)
    return result


@RULES.register("aten.prod.default")
def prod_all(ctx, x, *, dtype=None):
    return _prod(ctx, x, tuple(range(x.ndim)), False)


@RULES.register("aten.prod.dim_int")
def prod_dim(ctx, x, dim, keepdim=False, *, dtype=None):
    return _prod(ctx, x, dim_list(dim, x.ndim), keepdim)


def _moments(x, dims, correction, keepdim, dtype):
    # (sum((x - mean)^2) / max(0, n - correction), mean); correction defaults to 1 (Bessel)
    xf = x.astype(opmath(dtype))
    n = math.prod(x.shape[d] for d in dims)
    mean = jnp.sum(xf, axis=dims, keepdims=True) / n
    sq = jnp.sum(jnp.square(xf - mean), axis=dims, keepdims=keepdim)
    divisor = max(0, n - (1 if correction is None else correction))
    var = (sq / jnp.asarray(divisor, sq.dtype)).astype(dtype)
    return var, (mean if keepdim else jnp.squeeze(mean, dims)).astype(dtype)


@RULES.register("aten.var.correction")
def var(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _moments(x, dim_list(dim, x.ndim), correction, keepdim, out_dtype(ctx))[0]


@RULES.register("aten.var_mean.correction")
def var_mean(ctx, x, dim=None, *, correction=None, keepdim=False):
    return _moments(x, dim_list(dim, x.ndim), correction, keepdim, out_dtype(ctx))


@RULES.register("aten.linalg_vector_norm.default")
def vector_norm(ctx, x, ord=2, dim=None, keepdim=False, *, dtype=None):  # noqa: A002 (torch's)
    # ||x||_p = sum(|x|^p)^(1/p); p = inf / -inf: max / min |x|; p = 0: the count of nonzeros.
    # `dtype` casts x first (the recorded result dtype); half types compute in float32
    out = out_dtype(ctx)
    xf = x.astype(out).astype(opmath(out))
    dims = dim_list(dim, x.ndim)
    reduce = functools.partial(jnp.sum, axis=dims, keepdims=keepdim)
    p = float(ord)
    if p == math.inf:
        result = jnp.max(jnp.abs(xf), axis=dims, keepdims=keepdim)
    elif p == -math.inf:
        result = jnp.min(jnp.abs(xf), axis=dims, keepdims=keepdim)
    elif p == 0:
        result = reduce((xf != 0).astype(xf.dtype))
    elif p == 1:
        result = reduce(jnp.abs(xf))
    elif p == 2:
        result = jnp.sqrt(reduce(xf * xf))
    else:
        result = reduce(jnp.abs(xf) ** p) ** (1 / p)
    return result.astype(out)


@RULES.register("aten.topk.default")
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's argument name)
    # lax.top_k works on the last dim and returns the largest first (ties: lower index first);
    # the k smallest are the top k of an order-reversing map (-x, or ~x for integers)
    d = norm_dim(dim, x.ndim)
    moved = jnp.moveaxis(x, d, -1) if x.ndim else x.reshape(1)
    flip = (lambda v: ~v) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.negative
    keys = moved if largest else flip(moved)
    values, index = jax.lax.top_k(keys, k)
    values = values if largest else flip(values)
    index = index.astype(out_dtype(ctx, 1))
    if x.ndim == 0:
        return values.reshape(()), index.reshape(())
    return jnp.moveaxis(values, -1, d), jnp.moveaxis(index, -1, d)


@RULES.register("aten.cumsum.default")
def cumsum(ctx, x, dim, *, dtype=None):
    out = out_dtype(ctx)  # bool and int inputs sum in int64
    if x.ndim == 0:
        return x.astype(out)
    acc = opmath(out)
    return jnp.cumsum(x.astype(acc), axis=norm_dim(dim, x.ndim)).astype(out)


# softmax family: `dim` may be negative; half inputs compute in float32 (half_to_float returns it)


def _softmax_dim(x, dim):
    return norm_dim(dim, x.ndim) if x.ndim else None


@RULES.register("aten._softmax.default")
def softmax(ctx, x, dim, half_to_float=False):
    dtype = out_dtype(ctx)
    xf = x.astype(opmath(x.dtype))
    d = _softmax_dim(xf, dim)
    e = jnp.exp(xf - jnp.max(xf, axis=d, keepdims=True))
    return (e / jnp.sum(e, axis=d, keepdims=True)).astype(dtype)


@RULES.register("aten._log_softmax.default")
def log_softmax(ctx, x, dim, half_to_float=False):
    dtype = out_dtype(ctx)
    xf = x.astype(opmath(x.dtype))
    d = _softmax_dim(xf, dim)
    shifted = xf - jnp.max(xf, axis=d, keepdims=True)
    return (shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=d, keepdims=True))).astype(dtype)


@RULES.register("aten._softmax_backward_data.default")
def softmax_backward(ctx, grad, y, dim, input_dtype):
    # d softmax: y * (g - sum(g * y)); the result has the forward input's dtype
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    g, y = grad.astype(compute), y.astype(compute)
    d = _softmax_dim(y, dim)
    return (y * (g - jnp.sum(g * y, axis=d, keepdims=True))).astype(dtype)


@RULES.register("aten._log_softmax_backward_data.default")
def log_softmax_backward(ctx, grad, y, dim, input_dtype):
    # d log_softmax: g - exp(y) * sum(g)
    dtype = out_dtype(ctx)
    compute = opmath(dtype)
    g, y = grad.astype(compute), y.astype(compute)
    d = _softmax_dim(y, dim)
    return (g - jnp.exp(y) * jnp.sum(g, axis=d, keepdims=True)).astype(dtype)
