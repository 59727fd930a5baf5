"""Reductions, scans, top-k and the softmax family (forward and backward).

Torch conventions kept here: dims may be negative; `dim=None` or `[]` reduces every dim; sums
of bool/int tensors are int64 (the recorded result dtype); half-precision inputs accumulate in
float32 and round once; `max.dim`/`argmax`/`topk` return int64 indices of the first maximum.
"""

from __future__ import annotations

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


@RULES.register("aten.argmax.default")
def argmax(ctx, x, dim=None, keepdim=False):
    dtype = out_dtype(ctx)
    if x.ndim == 0:
        return jnp.zeros((), dtype)
    if dim is None:  # index into the flattened tensor; keepdim keeps every dim as 1
        index = jnp.argmax(x.reshape(-1)).astype(dtype)
        return index.reshape((1,) * x.ndim) if keepdim else index
    return jnp.argmax(x, axis=norm_dim(dim, x.ndim), keepdims=keepdim).astype(dtype)


@RULES.register("aten.var.correction")
def var(ctx, x, dim=None, *, correction=None, keepdim=False):
    # sum((x - mean)^2) / max(0, n - correction); correction defaults to 1 (Bessel)
    dtype = out_dtype(ctx)
    dims = dim_list(dim, x.ndim)
    xf = x.astype(opmath(dtype))
    n = 1
    for d in dims:
        n *= x.shape[d]
    mean = jnp.sum(xf, axis=dims, keepdims=True) / n
    sq = jnp.sum(jnp.square(xf - mean), axis=dims, keepdims=keepdim)
    divisor = max(0, n - (1 if correction is None else correction))
    return (sq / jnp.asarray(divisor, sq.dtype)).astype(dtype)


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
