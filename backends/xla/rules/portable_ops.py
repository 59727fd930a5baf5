"""`portable::` ops: attention, rms_norm, layer_norm (with backward ops) and the collectives.

Semantics are those of the CPU kernels in `portable/opset/nn_ops.py`:
- attention: softmax(q @ k^T * scale + mask) @ v with scale defaulting to 1/sqrt(head_dim); a
  bool mask keeps True positions, a float mask is added; `is_causal` is top-left aligned (query
  i sees keys j <= i); kv heads repeat for grouped-query attention. Written as plain softmax for
  now (the softmax-fusion issue adds a blockwise form). Half inputs compute in float32.
- rms_norm: torch's composite: x in float32 (opmath) * rsqrt(mean(x^2) + eps) * weight, rounded
  to the result dtype once; eps defaults to the opmath dtype's machine epsilon.
- backward ops are `jax.vjp` of these forwards (GQA gradients sum over the repeated heads).
- collectives over a group of one rank are the identity; larger groups need the spmd-partition
  pass, which maps them to XLA's collectives.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import RULES
from ._util import PRECISION, opmath, out_dtype, unsupported
from .nn import layer_norm_apply, layer_norm_stats


def attention(q, k, v, mask=None, is_causal=False, scale=None):
    """The reference attention on JAX arrays, in q's dtype (computed in opmath)."""
    dtype = q.dtype
    compute = opmath(dtype)
    hq, hk = q.shape[-3], k.shape[-3]
    if hq != hk:  # GQA: kv head j serves q heads j * group ... (j + 1) * group - 1
        k = jnp.repeat(k, hq // hk, axis=-3)
        v = jnp.repeat(v, hq // hk, axis=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = jnp.einsum(
        "...qd,...kd->...qk",
        q.astype(compute),
        k.astype(compute),
        precision=PRECISION,
        preferred_element_type=compute,
    )
    scores = scores * jnp.asarray(scale, compute)
    minus_inf = jnp.asarray(-jnp.inf, compute)  # typed: a bare Python float is float64 under x64
    if mask is not None:
        if mask.dtype == jnp.bool_:
            scores = jnp.where(mask, scores, minus_inf)
        else:
            scores = scores + mask.astype(dtype).astype(compute)
    if is_causal:
        lq, lk = scores.shape[-2:]
        keep = jnp.tril(jnp.ones((lq, lk), jnp.bool_))
        scores = jnp.where(keep, scores, minus_inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "...qk,...kd->...qd",
        probs,
        v.astype(compute),
        precision=PRECISION,
        preferred_element_type=compute,
    )
    return out.astype(dtype)


@RULES.register("portable.attention.default")
def attention_rule(ctx, q, k, v, mask=None, is_causal=False, scale=None):
    return attention(q, k, v, mask, is_causal, scale).astype(out_dtype(ctx))


@RULES.register("portable.attention_backward.default")
def attention_backward(ctx, grad, q, k, v, mask=None, is_causal=False, scale=None):
    _, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, mask, is_causal, scale), q, k, v)
    return vjp(grad.astype(q.dtype))


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


@RULES.register("portable.wait.default")
def wait(ctx, x):
    return x
