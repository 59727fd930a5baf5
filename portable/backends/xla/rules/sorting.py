"""Sorting and selection (sort, argsort, topk, kthvalue), scans (cumsum, cumprod), scatter
reductions and flips.

Torch conventions kept here: `sort` puts NaN after every number (first when descending) and
-0.0 level with 0.0; ties keep their index order (stable, which `stable=False` allows too);
indices are int64. `scatter_reduce` reduces src into x at `index` along dim, with x's own value
(`include_self`) or from the reduction's identity where index points; `mean` divides by the
count (floor division for integers) and leaves untouched entries as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import RULES
from ._util import norm_dim, opmath, out_dtype, out_shape, unsupported
from .shape import _along


@RULES.register("aten.flip.default")
def flip(ctx, x, dims):
    axes = tuple(sorted({norm_dim(d, x.ndim) for d in dims}))
    if not axes or x.ndim == 0:
        return x
    return jnp.flip(x, axis=axes)


def _sort(ctx, x, dim, descending):
    # lax.sort orders floats totally with -0.0 == 0.0 and every NaN last, as torch does. Stable
    # descending order is the reverse of the stable ascending order of the reversed input: ties
    # come back in index order and NaN first.
    index_dtype = out_dtype(ctx, 1)
    if x.ndim == 0:
        return x, jnp.zeros((), index_dtype)
    d = norm_dim(dim, x.ndim)
    keys = jnp.flip(x, d) if descending else x
    keys = keys.astype(jnp.int8) if keys.dtype == jnp.bool_ else keys
    iota = jax.lax.broadcasted_iota(index_dtype, x.shape, d)
    _, index = jax.lax.sort((keys, iota), dimension=d, is_stable=True, num_keys=1)
    if descending:
        index = jnp.flip(x.shape[d] - 1 - index, d)
    return jnp.take_along_axis(x, index, axis=d), index


@RULES.register("aten.sort.default")
def sort(ctx, x, dim=-1, descending=False):
    return _sort(ctx, x, dim, descending)


@RULES.register("aten.sort.stable")
def sort_stable(ctx, x, *, stable=None, dim=-1, descending=False):
    return _sort(ctx, x, dim, descending)


@RULES.register("aten.cumprod.default")
def cumprod(ctx, x, dim, *, dtype=None):
    out = out_dtype(ctx)  # bool and int inputs multiply in int64
    if x.ndim == 0:
        return x.astype(out)
    return jnp.cumprod(x.astype(opmath(out)), axis=norm_dim(dim, x.ndim)).astype(out)


def _identity(reduce: str, dtype: jnp.dtype) -> float | int | bool:
    """The value `reduce` starts from where include_self=False (lowest / highest for amax / amin)."""
    if reduce in ("sum", "mean"):
        return 0
    if reduce == "prod":
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return -jnp.inf if reduce == "amax" else jnp.inf
    info = jnp.iinfo(dtype)
    return info.min if reduce == "amax" else info.max


_COMBINE = {"sum": "add", "mean": "add", "prod": "multiply", "amax": "max", "amin": "min"}
_COMBINE_BOOL = {"sum": "max", "prod": "min", "amax": "max", "amin": "min"}  # or, and, or, and


@RULES.register("aten.scatter_reduce.two")
def scatter_reduce(ctx, x, dim, index, src, reduce, *, include_self=True):
    # out = x; out[index] (=) identity unless include_self; out[index] op= src[:index.shape];
    # mean: out / max(1, count of values reduced into each entry)
    if reduce not in _COMBINE:
        raise unsupported(
            ctx,
            f"scatter_reduce has no reduction {str(reduce)[:40]!r}",
            "use one of reduce='sum', 'prod', 'mean', 'amax', 'amin'",
        )
    out = out_dtype(ctx)
    if out == jnp.bool_ and reduce == "mean":
        raise unsupported(
            ctx,
            "scatter_reduce with reduce='mean' of bool tensors (eager PyTorch refuses it too)",
            "cast x and src to an integer or float dtype first",
        )
    # bool computes in int8 (sum and amax: or, prod and amin: and), half types in float32,
    # rounded once (mean: the sum rounded, then divided, as torch's kernel)
    compute = jnp.int8 if out == jnp.bool_ else opmath(out)
    combine = (_COMBINE_BOOL if out == jnp.bool_ else _COMBINE)[reduce]
    acc = x.astype(compute)
    if x.ndim == 0:  # as a 1-element vector
        acc, index, src = acc.reshape(1), index.reshape(1), src.reshape(1)
    cropped_src = src[tuple(slice(0, n) for n in index.shape)].astype(compute)
    _, coords, _ = _along(acc, index, dim)
    if not include_self:
        acc = acc.at[coords].set(jnp.asarray(_identity(reduce, compute), compute))
    acc = getattr(acc.at[coords], combine)(cropped_src)
    if reduce == "mean":
        count = jnp.full(acc.shape, 1 if include_self else 0, compute).at[coords].add(1)
        count = jnp.maximum(count, 1)
        if jnp.issubdtype(compute, jnp.floating):
            acc = acc.astype(out).astype(compute) / count
        else:
            acc = jnp.floor_divide(acc, count)
    if out == jnp.bool_:
        acc = acc != 0
    return acc.astype(out).reshape(out_shape(ctx))
