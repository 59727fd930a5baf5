"""Loss ops kept whole by the opset: mse_loss and nll_loss, forward and backward.

`reduction` is torch's enum: 0 none, 1 mean, 2 sum. nll_loss takes [N, C] or [C] log
probabilities; targets equal to `ignore_index` weigh 0 (they may be out of range, e.g. -100);
the mean divides by the total weight of the counted targets (NaN when it is 0, as in torch).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import RULES
from ._util import out_dtype, out_shape, reduce_mean, reduce_sum

NONE, MEAN, SUM = 0, 1, 2


def _reduce(x, reduction, dtype):
    dims = tuple(range(x.ndim))
    if reduction == MEAN:
        return reduce_mean(x, dims, False, dtype)
    if reduction == SUM:
        return reduce_sum(x, dims, False, dtype)
    return x


@RULES.register("aten.mse_loss.default")
def mse_loss(ctx, x, target, reduction=MEAN):
    dtype = out_dtype(ctx)
    d = x.astype(dtype) - target.astype(dtype)
    return _reduce(d * d, reduction, dtype)


@RULES.register("aten.mse_loss_backward.default")
def mse_loss_backward(ctx, grad, x, target, reduction):
    # torch: norm * (x - target) * grad, norm = 2 / numel (mean) or 2, rounded to the dtype first
    dtype = out_dtype(ctx)
    norm = 2 / x.size if reduction == MEAN else 2.0
    d = x.astype(dtype) - target.astype(dtype)
    return jnp.asarray(norm, dtype) * d * grad.astype(dtype)


def _nll_terms(x, target, weight, ignore_index):
    """Per row: (x[i, t_i], the weight of t_i (0 where ignored), safe targets, counted mask)."""
    rows = x.reshape(-1, x.shape[-1])
    t = target.reshape(-1)
    counted = t != ignore_index
    safe = jnp.where(counted, t, 0)
    picked = jnp.take_along_axis(rows, safe[:, None], axis=1)[:, 0]
    w = jnp.ones_like(picked) if weight is None else weight.astype(x.dtype)[safe]
    return picked, jnp.where(counted, w, 0), safe, counted


@RULES.register("aten.nll_loss_forward.default")
def nll_loss_forward(ctx, x, target, weight, reduction, ignore_index):
    # -> (loss, total weight); the total weight is 0 with reduction "none"
    picked, w, _, _ = _nll_terms(x, target, weight, ignore_index)
    dtype = out_dtype(ctx)
    losses = -(picked * w)
    if reduction == NONE:
        return losses.reshape(out_shape(ctx)).astype(dtype), jnp.zeros((), out_dtype(ctx, 1))
    total_weight = jnp.sum(w)
    loss = -jnp.sum(picked * w)
    if reduction == MEAN:
        loss = loss / total_weight
    return loss.astype(dtype), total_weight.astype(out_dtype(ctx, 1))


@RULES.register("aten.nll_loss_backward.default")
def nll_loss_backward(ctx, grad, x, target, weight, reduction, ignore_index, total_weight):
    # d loss / d x[i, t_i] = -w_i * grad (/ total weight for the mean); 0 everywhere else
    _, w, safe, counted = _nll_terms(x, target, weight, ignore_index)
    g = grad.reshape(-1) if reduction == NONE else grad.reshape(())
    if reduction == MEAN:
        g = g / total_weight
    value = jnp.where(counted, -w * g, 0)
    rows = jnp.zeros((safe.shape[0], x.shape[-1]), out_dtype(ctx))
    rows = rows.at[jnp.arange(safe.shape[0]), safe].set(value.astype(rows.dtype))
    return rows.reshape(x.shape)
