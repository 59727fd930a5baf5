"""Shape, layout, slicing and indexing ops.

Values are immutable in JAX, so torch's views (`view`, `permute`, `slice`, ...) are copies and
`*_scatter` / `index_put` return the updated tensor. Torch conventions kept here: negative dims
and indices count from the end; slice bounds are clamped like Python's (`end=INT64_MAX` means
the end); `squeeze` ignores dims whose size is not 1; `cat` skips legacy empty 1-D tensors;
`gather`/`scatter` index tensors may be smaller than the tensor in the other dims.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from . import RULES
from ._util import norm_dim, out_dtype, out_shape, unsupported

if TYPE_CHECKING:
    from . import RuleContext


@RULES.register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
def view(ctx, x, shape):
    return jnp.reshape(x, tuple(shape))


@RULES.register("aten.permute.default")
def permute(ctx, x, dims):
    return jnp.transpose(x, [norm_dim(d, x.ndim) for d in dims])


@RULES.register("aten.transpose.int")
def transpose(ctx, x, dim0, dim1):
    if x.ndim < 2:
        return x
    return jnp.swapaxes(x, norm_dim(dim0, x.ndim), norm_dim(dim1, x.ndim))


@RULES.register("aten.t.default")
def t(ctx, x):
    return transpose(ctx, x, 0, 1)


@RULES.register("aten.unsqueeze.default")
def unsqueeze(ctx, x, dim):
    return jnp.expand_dims(x, dim % (x.ndim + 1))


@RULES.register("aten.squeeze.dims")
def squeeze_dims(ctx, x, dims):
    if x.ndim == 0:
        return x
    drop = {norm_dim(d, x.ndim) for d in dims}
    return jnp.squeeze(x, axis=tuple(d for d in sorted(drop) if x.shape[d] == 1))


@RULES.register("aten.squeeze.dim")
def squeeze_dim(ctx, x, dim):
    return squeeze_dims(ctx, x, [dim])


@RULES.register("aten.expand.default")
def expand(ctx, x, size, *, implicit=False):
    # size aligns with x's trailing dims; -1 keeps that dim's size
    lead = len(size) - x.ndim
    shape = [x.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(size)]
    return jnp.broadcast_to(x, shape)


@RULES.register("aten.clone.default", "aten.alias.default", "aten.lift_fresh_copy.default")
def identity(ctx, x, **_ignored):  # memory_format is a layout request: nothing to do in XLA
    return x


@RULES.register("aten._to_copy.default")
def to_copy(ctx, x, **_ignored):
    # dtype is the recorded result dtype; layout/device/pin_memory/memory_format do not apply.
    # float -> int truncates toward zero and float/int -> bool is `!= 0`, as in torch.
    return x.astype(out_dtype(ctx))


@RULES.register("aten.cat.default")
def cat(ctx, tensors, dim=0):
    dtype = out_dtype(ctx)
    kept = [t for t in tensors if t.shape != (0,)]  # torch skips 1-D empty tensors
    if not kept:
        return jnp.zeros(out_shape(ctx), dtype)
    return jnp.concatenate([t.astype(dtype) for t in kept], axis=norm_dim(dim, kept[0].ndim))


@RULES.register("aten.stack.default")
def stack(ctx, tensors, dim=0):
    dtype = out_dtype(ctx)
    return jnp.stack([t.astype(dtype) for t in tensors], axis=dim % (tensors[0].ndim + 1))


@RULES.register("aten.split_with_sizes.default")
def split_with_sizes(ctx, x, split_sizes, dim=0):
    d = norm_dim(dim, x.ndim)
    out, start = [], 0
    for size in split_sizes:
        out.append(jax.lax.slice_in_dim(x, start, start + int(size), axis=d))
        start += int(size)
    return tuple(out)


def _slice_key(
    x: jax.Array, dim: int, start: int | None, end: int | None, step: int
) -> tuple[slice, ...]:
    """The static index of `x[start:end:step]` along dim (Python's clamping of the bounds)."""
    d = norm_dim(dim, x.ndim)
    return (slice(None),) * d + (slice(start, end, step),)


@RULES.register("aten.slice.Tensor")
def slice_(ctx, x, dim=0, start=None, end=None, step=1):
    return x[_slice_key(x, dim, start, end, step)]


@RULES.register("aten.slice_scatter.default")
def slice_scatter(ctx, x, src, dim=0, start=None, end=None, step=1):
    return x.at[_slice_key(x, dim, start, end, step)].set(src.astype(x.dtype))


def _select_key(x: jax.Array, dim: int, index: int) -> tuple[slice | int, ...]:
    d = norm_dim(dim, x.ndim)
    return (slice(None),) * d + (int(index) % x.shape[d],)


@RULES.register("aten.select.int")
def select(ctx, x, dim, index):
    return x[_select_key(x, dim, index)]


@RULES.register("aten.select_scatter.default")
def select_scatter(ctx, x, src, dim, index):
    return x.at[_select_key(x, dim, index)].set(src.astype(x.dtype))


def _advanced_key(
    ctx: RuleContext, indices: Sequence[jax.Array | None]
) -> tuple[slice | jax.Array, ...]:
    """torch's `Tensor?[] indices` as a numpy index: None is a full slice; integer index tensors
    broadcast together (numpy's advanced-indexing rules, which torch follows)."""
    key: list[slice | jax.Array] = []
    for index in indices:
        if index is None:
            key.append(slice(None))
        elif index.dtype == jnp.bool_:
            raise unsupported(
                ctx,
                "boolean-mask indexing has a data-dependent shape, which XLA cannot compile",
                "use torch.where(mask, ...) or masked_fill instead of x[mask]",
            )
        else:
            key.append(index)
    return tuple(key)


@RULES.register("aten.index.Tensor")
def index(ctx, x, indices):
    return x[_advanced_key(ctx, indices)]


@RULES.register("aten.index_put.default")
def index_put(ctx, x, indices, values, accumulate=False):
    values = values.astype(x.dtype)
    if len(indices) == 1 and indices[0] is not None and indices[0].dtype == jnp.bool_:
        # x[mask] = v with a one-element v is a select: the result shape does not depend on data
        mask = indices[0]
        if values.size != 1:
            raise unsupported(
                ctx,
                "x[mask] = values with several values has a data-dependent shape",
                "assign one value (masked_fill) or use torch.where",
            )
        mask = mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))
        v = values.reshape(())
        added = (x | v) if x.dtype == jnp.bool_ else x + v
        return jnp.where(mask, added if accumulate else v, x)
    ref = x.at[_advanced_key(ctx, indices)]
    # with duplicate indices torch leaves which write wins unspecified; accumulate sums them all
    # (on bools, sums are logical or: any True write makes True)
    if accumulate and x.dtype == jnp.bool_:
        return ref.max(values)
    return ref.add(values) if accumulate else ref.set(values)


@RULES.register("aten.index_select.default")
def index_select(ctx, x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, index.reshape(-1), axis=norm_dim(dim, x.ndim))


def _along(x, index, dim):
    """(x cropped to index's shape outside dim, the full coordinate tuple of index's elements)."""
    d = norm_dim(dim, x.ndim)
    crop = tuple(slice(None) if i == d else slice(0, n) for i, n in enumerate(index.shape))
    coords = tuple(
        index if i == d else jax.lax.broadcasted_iota(index.dtype, index.shape, i)
        for i in range(index.ndim)
    )
    return x[crop], coords, d


@RULES.register("aten.gather.default")
def gather(ctx, x, dim, index, *, sparse_grad=False):
    if x.ndim == 0:
        return x
    cropped, _, d = _along(x, index, dim)
    return jnp.take_along_axis(cropped, index, axis=d)


def _scatter(
    ctx: RuleContext, x: jax.Array, dim: int, index: jax.Array, src: Any, combine: str
) -> jax.Array:
    # src: a JAX array (scatter.src) or a Python scalar (scatter.value), told apart by duck type
    if x.ndim == 0:
        return x.at[()].set(src) if combine == "set" else x + src
    _, coords, _ = _along(x, index, dim)
    if hasattr(src, "shape") and src.ndim:
        src = src[tuple(slice(0, n) for n in index.shape)]  # only src[:index.shape] is used
    src = jnp.asarray(src, x.dtype) if not hasattr(src, "dtype") else src.astype(x.dtype)
    return getattr(x.at[coords], combine)(src)


@RULES.register("aten.scatter.src")
def scatter_src(ctx, x, dim, index, src):
    return _scatter(ctx, x, dim, index, src, "set")


@RULES.register("aten.scatter.value")
def scatter_value(ctx, x, dim, index, value):
    return _scatter(ctx, x, dim, index, value, "set")


@RULES.register("aten.scatter_add.default")
def scatter_add(ctx, x, dim, index, src):
    return _scatter(ctx, x, dim, index, src, "add")


@RULES.register("aten.constant_pad_nd.default")
def constant_pad_nd(ctx, x, pad, value=0):
    # pad = (last_lo, last_hi, second_last_lo, ...); negative amounts crop
    config = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        config[x.ndim - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]), 0)
    return jax.lax.pad(x, jnp.asarray(value, x.dtype), config)


@RULES.register("aten.tril.default")
def tril(ctx, x, diagonal=0):
    return jnp.tril(x, k=diagonal)


@RULES.register("aten.triu.default")
def triu(ctx, x, diagonal=0):
    return jnp.triu(x, k=diagonal)


@RULES.register("aten.diagonal.default")
def diagonal(ctx, x, offset=0, dim1=0, dim2=1):
    # x[..., i, i + offset] over the (dim1, dim2) planes, as a new last dim (numpy's convention)
    return jnp.diagonal(x, offset, norm_dim(dim1, x.ndim), norm_dim(dim2, x.ndim))


@RULES.register("aten.diagonal_scatter.default")
def diagonal_scatter(ctx, x, src, offset=0, dim1=0, dim2=1):
    # move (dim1, dim2) last, write src's last dim along the diagonal, move them back
    d1, d2 = norm_dim(dim1, x.ndim), norm_dim(dim2, x.ndim)
    planes = jnp.moveaxis(x, (d1, d2), (-2, -1))
    i = jnp.arange(src.shape[-1])
    planes = planes.at[..., i + max(-offset, 0), i + max(offset, 0)].set(src.astype(x.dtype))
    return jnp.moveaxis(planes, (-2, -1), (d1, d2))


@RULES.register("aten.repeat.default")
def repeat(ctx, x, repeats):
    # len(repeats) >= x.ndim; x gains leading size-1 dims first, as numpy's tile does
    return jnp.tile(x, tuple(int(r) for r in repeats))
