"""`portable::` ops: scale_mask_softmax, rms_norm, layer_norm (with backward ops), collectives.

Attention (forward and backward) lives in `attention.py`. Semantics are those of the CPU kernels
in `portable/opset/nn_ops.py`:
- rms_norm: torch's composite: x in float32 (opmath) * rsqrt(mean(x^2) + eps) * weight, rounded
  to the result dtype once; eps defaults to the opmath dtype's machine epsilon.
- backward ops are `jax.vjp` of these forwards.
- collectives over a group of one rank are the identity; a per-rank program's larger groups lower
  through `ctx.collectives` (XLA collectives over named mesh axes under shard_map, or explicit
  replica groups for neuron).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from . import RULES
from ._util import opmath, out_dtype, unsupported
from .nn import layer_norm_apply, layer_norm_stats

if TYPE_CHECKING:
    from . import RuleContext


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
#
# A single-rank program (ctx.collectives is None) may only hold groups of one rank, where every
# collective is the identity. A per-rank program is lowered with a collectives object: the
# shard_map form below (named mesh axes, backends/xla/spmd.py) or the neuron backend's explicit
# replica groups (backends/neuron/collectives.py).


class NamedAxisCollectives:
    """Collectives over named mesh axes, for tracing inside `jax.shard_map` over the mesh."""

    def all_reduce(self, x, reduce_op, axis, group_size):
        # avg = sum / n; max, min: elementwise over the group
        return {
            "sum": jax.lax.psum,
            "avg": jax.lax.pmean,
            "max": jax.lax.pmax,
            "min": jax.lax.pmin,
        }[reduce_op](x, axis)

    def all_gather(self, x, dim, axis, group_size):
        # concat(x of each rank, in coordinate order on axis) along dim
        return jax.lax.all_gather(x, axis, axis=dim, tiled=True)

    def reduce_scatter(self, x, reduce_op, dim, axis, group_size):
        # chunk i (i = this rank's coordinate on axis) of all_reduce(x) along dim
        if reduce_op in ("sum", "avg"):
            out = jax.lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)
            return out / jnp.asarray(group_size, out.dtype) if reduce_op == "avg" else out
        return self.local_shard(
            self.all_reduce(x, reduce_op, axis, group_size), dim, axis, group_size
        )

    def all_to_all(self, x, split_dim, concat_dim, axis, group_size):
        # chunk j along split_dim goes to rank j; received chunks concatenated in rank order
        return jax.lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)

    def local_shard(self, x, dim, axis, group_size):
        size = x.shape[dim] // group_size
        start = jax.lax.axis_index(axis) * size
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)

    def wait(self, x):
        return x


def _collective(
    ctx: RuleContext, op: str, x: jax.Array, axis: str, group_size: int, *args: Any
) -> jax.Array:
    if ctx.collectives is None:
        if group_size != 1:
            raise unsupported(
                ctx,
                f"{op} over mesh axis {axis!r} with group_size {group_size} in a single-rank "
                "lowering",
                "a program with multi-rank collectives is a per-rank program: produce it with the "
                "spmd-partition pass, which records its layout (`Program.spmd`), and "
                "`portable.compile` runs it on mesh.size XLA devices",
            )
        return x
    return getattr(ctx.collectives, op)(x, *args, axis, group_size)


@RULES.register("portable.all_reduce.default")
def all_reduce(ctx, x, reduce_op, axis, group_size):
    return _collective(ctx, "all_reduce", x, axis, group_size, reduce_op)


@RULES.register("portable.all_gather.default")
def all_gather(ctx, x, dim, axis, group_size):
    return _collective(ctx, "all_gather", x, axis, group_size, dim)


@RULES.register("portable.reduce_scatter.default")
def reduce_scatter(ctx, x, reduce_op, dim, axis, group_size):
    return _collective(ctx, "reduce_scatter", x, axis, group_size, reduce_op, dim)


@RULES.register("portable.all_to_all.default")
def all_to_all(ctx, x, split_dim, concat_dim, axis, group_size):
    return _collective(ctx, "all_to_all", x, axis, group_size, split_dim, concat_dim)


@RULES.register("portable.local_shard.default")
def local_shard(ctx, x, dim, axis, group_size):
    return _collective(ctx, "local_shard", x, axis, group_size, dim)


@RULES.register("portable.wait.default")
def wait(ctx, x):
    return x if ctx.collectives is None else ctx.collectives.wait(x)
