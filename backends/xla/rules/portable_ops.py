"""`portable::` ops: scale_mask_softmax, rms_norm, layer_norm (with backward ops), collectives.

Attention (forward and backward) lives in `attention.py`. Semantics are those of the CPU kernels
in `portable/opset/nn_ops.py`:
- rms_norm: torch's composite: x in float32 (opmath) * rsqrt(mean(x^2) + eps) * weight, rounded
  to the result dtype once; eps defaults to the opmath dtype's machine epsilon.
- backward ops are `jax.vjp` of these forwards.
- collectives over a group of one rank are the identity; larger groups need the spmd-partition
  pass, which maps them to XLA's collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import RULES
from ._util import opmath, out_dtype, unsupported
from .nn import layer_norm_apply, layer_norm_stats


@RULES.register("portable.scale_mask_softmax.default")
def scale_mask_softmax(ctx, x, mask=None, scale=1.0, dim=-1):
    compute = opmath(x.dtype)
    s = x.astype(compute) * jnp.asarray(scale, compute)
    if mask is not None:
        if mask.dtype == jnp.bool_:
            s = jnp.where(mask, s, jnp.asarray(-jnp.inf, compute))
        else:
            s = s + mask.astype(compute)
    return jax.nn.softmax(s, axis=dim).astype(out_dtype(ctx))


def rms_norm(x, normalized_shape, weight=None, eps=None):
    compute = opmath(x.dtype)
    eps = jnp.finfo(compute).eps if eps is None else eps
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(compute)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=dims, keepdims=True) + jnp.asarray(eps, compute))
    y = xf * r
    if weight is not None:
        y = y * weight.astype(jnp.promote_types(weight.dtype, compute))
    return y


@RULES.register("portable.rms_norm.default")
def rms_norm_rule(ctx, x, normalized_shape, weight=None, eps=None):
    return rms_norm(x, normalized_shape, weight, eps).astype(out_dtype(ctx))


@RULES.register("portable.rms_norm_backward.default")
def rms_norm_backward(ctx, grad, x, normalized_shape, weight=None, eps=None):
    # -> (dx, dweight); dweight is zeros when there is no weight
    if weight is None:
        _, vjp = jax.vjp(lambda x: rms_norm(x, normalized_shape, None, eps).astype(x.dtype), x)
        (dx,) = vjp(grad.astype(x.dtype))
        return dx.astype(out_dtype(ctx, 0)), jnp.zeros(tuple(normalized_shape), out_dtype(ctx, 1))
    out = out_dtype(ctx, 0)
    _, vjp = jax.vjp(lambda x, w: rms_norm(x, normalized_shape, w, eps).astype(out), x, weight)
    dx, dw = vjp(grad.astype(out))
    return dx.astype(out_dtype(ctx, 0)), dw.astype(out_dtype(ctx, 1))


@RULES.register("portable.layer_norm.default")
def layer_norm(ctx, x, normalized_shape, weight=None, bias=None, eps=1e-5):
    mean, rstd = layer_norm_stats(x, normalized_shape, eps)
    return layer_norm_apply(x, mean, rstd, weight, bias).astype(out_dtype(ctx))


# --------------------------------------------------------------------------- collectives


def _single_rank(ctx, op: str, x, group_size: int, axis: str):
    if group_size != 1:
        raise unsupported(
            ctx,
            f"{op} over mesh axis {axis!r} with group_size {group_size} needs multi-device "
            "lowering, which comes with the spmd-partition pass",
            "apply the spmd-partition pass before lowering, or run the single-rank program "
            "(group_size 1) on one device",
        )
    return x


@RULES.register("portable.all_reduce.default")
def all_reduce(ctx, x, reduce_op, axis, group_size):
    return _single_rank(ctx, "all_reduce", x, group_size, axis)


@RULES.register("portable.all_gather.default")
def all_gather(ctx, x, dim, axis, group_size):
    return _single_rank(ctx, "all_gather", x, group_size, axis)


@RULES.register("portable.reduce_scatter.default")
def reduce_scatter(ctx, x, reduce_op, dim, axis, group_size):
    return _single_rank(ctx, "reduce_scatter", x, group_size, axis)


@RULES.register("portable.all_to_all.default")
def all_to_all(ctx, x, split_dim, concat_dim, axis, group_size):
    return _single_rank(ctx, "all_to_all", x, group_size, axis)


@RULES.register("portable.local_shard.default")
def local_shard(ctx, x, dim, axis, group_size):
    return _single_rank(ctx, "local_shard", x, group_size, axis)


@RULES.register("portable.wait.default")
def wait(ctx, x):
    return x
