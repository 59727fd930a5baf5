"""Neuron forms of rules whose generic HLO neuronx-cc rejects (platform "neuron").

The neuron backend's validator (backends/neuron/validate.py) refuses what the compiler rejects;
these overrides give the same results in forms it accepts:

- `argmax`, `max.dim`, `max_pool2d_with_indices`: `jnp.argmax` lowers to a variadic reduce over
  (value, index), which neuronx-cc rejects. Here the first maximum's index is two one-operand
  reductions: `m = max(x)`, then `min(where(x == m or isnan(x), iota, n))`; NaN counts as the
  maximum and ties go to the lower index, as in torch and `jnp.argmax`.
- `topk`: `lax.top_k` is the HLO `topk` opcode, which is not on the Neuron allow-list. Here a
  stable ascending sort of (order-reversed key, iota) and a slice: the largest first, ties by
  lower index, as `lax.top_k`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import RULES
from ._util import norm_dim, out_dtype, out_shape
from .nn import _pool_args, _windows


def first_argmax(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """Index (int32) of the first maximum of `x` along `axis`, NaN being the maximum."""
    m = jnp.max(x, axis=axis, keepdims=True)
    hit = x == m
    if jnp.issubdtype(x.dtype, jnp.floating):
        hit = hit | jnp.isnan(x)  # m is NaN when x has one: the first NaN is the answer
    n = x.shape[axis]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
    index = jnp.min(jnp.where(hit, iota, jnp.int32(n)), axis=axis, keepdims=True)
    return index if keepdims else jnp.squeeze(index, axis)


@RULES.register("aten.argmax.default", platform="neuron")
def argmax(ctx, x, dim=None, keepdim=False):
    dtype = out_dtype(ctx)
    if x.ndim == 0:
        return jnp.zeros((), dtype)
    if dim is None:  # index into the flattened tensor; keepdim keeps every dim as 1
        index = first_argmax(x.reshape(-1), 0).astype(dtype)
        return index.reshape((1,) * x.ndim) if keepdim else index
    return first_argmax(x, norm_dim(dim, x.ndim), keepdim).astype(dtype)


@RULES.register("aten.max.dim", platform="neuron")
def max_dim(ctx, x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), out_dtype(ctx, 1))
    d = norm_dim(dim, x.ndim)
    index = first_argmax(x, d, keepdim).astype(out_dtype(ctx, 1))
    return jnp.max(x, axis=d, keepdims=keepdim), index


@RULES.register("aten.topk.default", platform="neuron")
def topk(ctx, x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's argument name)
    d = norm_dim(dim, x.ndim)
    moved = jnp.moveaxis(x, d, -1) if x.ndim else x.reshape(1)
    flip = (lambda v: ~v) if jnp.issubdtype(x.dtype, jnp.integer) else jnp.negative
    # ascending order of the reversed key = the largest (or, reversed twice, smallest) first
    keys = flip(moved) if largest else moved
    iota = jax.lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
    keys, index = jax.lax.sort((keys, iota), dimension=keys.ndim - 1, is_stable=True, num_keys=1)
    values = (flip(keys) if largest else keys)[..., :k]
    index = index[..., :k].astype(out_dtype(ctx, 1))
    if x.ndim == 0:
        return values.reshape(()), index.reshape(())
    return jnp.moveaxis(values, -1, d), jnp.moveaxis(index, -1, d)


@RULES.register("aten.max_pool2d_with_indices.default", platform="neuron")
def max_pool2d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    # the generic rule (nn.py) with `first_argmax` in place of jnp.argmax
    k, s, p, d = _pool_args(x, kernel_size, stride, padding, dilation)
    oh, ow = out_shape(ctx)[-2:]
    taps = _windows(x, k, s, p, d, (oh, ow), -jnp.inf)
    tap = first_argmax(taps, taps.ndim - 1)
    values = jnp.max(taps, axis=-1)
    row = jnp.arange(oh, dtype=jnp.int32)[:, None] * s[0] - p[0] + (tap // k[1]) * d[0]
    col = jnp.arange(ow, dtype=jnp.int32)[None, :] * s[1] - p[1] + (tap % k[1]) * d[1]
    return values, (row * x.shape[-1] + col).astype(out_dtype(ctx, 1))
