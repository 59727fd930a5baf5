"""Matmuls, embedding, convolution, the 2-d pools and the batch / layer / group norm ATen ops
(interpolation and the adaptive-max and 3-d pools: resample.py).

Contracts:
- matmuls accumulate in float32 (for half inputs) at full precision, never reduced-precision;
- convolution is N-d (NC[spatial] inputs, OI[spatial] weights); its backward, and the backward of
  transposed convolution and of the average pools, are `jax.vjp` of the forward (they are linear);
- `max_pool2d_with_indices` returns int64 indices into each input plane, flattened (h * W + w);
- norms return the statistics torch returns (mean and 1/std), with its shapes and dtypes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import RULES
from ._util import PRECISION, matmul, opmath, out_dtype, out_shape, pair, reduce_sum, rounded

# --------------------------------------------------------------------------- matmul


@RULES.register("aten.mm.default", "aten.bmm.default")
def mm(ctx, x, y):
    return matmul(x, y, out_dtype(ctx))


@RULES.register("aten.addmm.default")
def addmm(ctx, bias, x, w, *, beta=1, alpha=1):
    # torch: beta * bias + alpha * (x @ w); with beta == 0 the bias is ignored (even NaN)
    dtype = out_dtype(ctx)
    out = matmul(x, w, dtype)
    if alpha != 1:
        out = out * jnp.asarray(alpha, dtype)
    if beta == 0:
        return out
    bias = bias.astype(dtype)
    return (bias if beta == 1 else bias * jnp.asarray(beta, dtype)) + out


# --------------------------------------------------------------------------- embedding


@RULES.register("aten.embedding.default")
def embedding(ctx, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@RULES.register("aten.embedding_dense_backward.default")
def embedding_dense_backward(ctx, grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    # rows of grad summed into their index's row; the padding_idx row gets nothing;
    # scale_grad_by_freq divides each contribution by its index's count in the batch
    dtype = out_dtype(ctx)
    flat = indices.reshape(-1)
    rows = grad.reshape(flat.shape[0], -1).astype(opmath(dtype))
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), rows.dtype).at[flat].add(1)
        rows = rows / counts[flat][:, None]
    if padding_idx >= 0:
        rows = jnp.where((flat == padding_idx)[:, None], 0, rows)
    out = jnp.zeros((num_weights, rows.shape[1]), rows.dtype).at[flat].add(rows)
    return out.astype(dtype)


# --------------------------------------------------------------------------- convolution


def _conv(x, weight, stride, padding, dilation, transposed, output_padding, groups, out_shape_):
    n = x.ndim - 2
    stride, padding, dilation = pair(stride, n), pair(padding, n), pair(dilation, n)
    spatial = "DHW"[-n:]  # torch convolves over 1 to 3 spatial dims
    dims = ("NC" + spatial, "OI" + spatial, "NC" + spatial)

    def forward(inp):
        return jax.lax.conv_general_dilated(
            inp,
            weight,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=dims,
            feature_group_count=groups,
            precision=PRECISION,
            preferred_element_type=opmath(x.dtype),
        ).astype(x.dtype)

    if not transposed:
        return forward(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):  # JAX has no adjoint of an integer function
        return _integer_transposed(x, weight, stride, padding, dilation, output_padding, groups)
    # a transposed convolution is the adjoint of the forward convolution whose input has the
    # transposed convolution's output shape (weight [C_in, C_out / groups, k...] is read as OI)
    _, adjoint = jax.vjp(forward, jnp.zeros(out_shape_, x.dtype))
    return adjoint(x)[0]


def _integer_transposed(x, weight, stride, padding, dilation, output_padding, groups):
    """conv_transpose of integers as the direct convolution it is: the input dilated by the
    stride, the kernel flipped with its in / out channels swapped per group, padded by
    dilation * (k - 1) - padding (plus output_padding at the end)."""
    n = x.ndim - 2
    stride, padding, dilation = pair(stride, n), pair(padding, n), pair(dilation, n)
    output_padding = pair(output_padding, n)
    c_in, c_out_g, *k = weight.shape
    w = weight.reshape(groups, c_in // groups, c_out_g, *k).swapaxes(1, 2)
    w = w.reshape(groups * c_out_g, c_in // groups, *k)
    w = jnp.flip(w, axis=tuple(range(2, 2 + n)))
    spatial = "DHW"[-n:]
    edges = [
        (dd * (kk - 1) - pp, dd * (kk - 1) - pp + op)
        for dd, kk, pp, op in zip(dilation, k, padding, output_padding, strict=True)
    ]
    return jax.lax.conv_general_dilated(
        x,
        w,
        window_strides=(1,) * n,
        padding=edges,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=("NC" + spatial, "OI" + spatial, "NC" + spatial),
        feature_group_count=groups,
        preferred_element_type=x.dtype,
    )


@RULES.register("aten.convolution.default")
def convolution(
    ctx, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
):
    dtype = out_dtype(ctx)
    y = _conv(
        x.astype(dtype),
        weight.astype(dtype),
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        out_shape(ctx),
    )
    if bias is not None:
        y = y + bias.astype(dtype).reshape((1, -1) + (1,) * (y.ndim - 2))
    return y


@RULES.register("aten.convolution_backward.default")
def convolution_backward(
    ctx,
    grad,
    x,
    weight,
    bias_sizes,
    stride,
    padding,
    dilation,
    transposed,
    output_padding,
    groups,
    output_mask,
):
    # output_mask selects (grad_input, grad_weight, grad_bias); unselected results are None
    def forward(inp, w):
        return _conv(
            inp, w, stride, padding, dilation, transposed, output_padding, groups, grad.shape
        )

    _, vjp = jax.vjp(forward, x, weight)
    dx, dw = vjp(grad.astype(x.dtype))
    db = None
    if output_mask[2]:
        db = reduce_sum(grad, (0, *range(2, grad.ndim)), False, out_dtype(ctx, 2))
    return (dx if output_mask[0] else None, dw if output_mask[1] else None, db)


# --------------------------------------------------------------------------- pooling


def _pool_args(x, kernel_size, stride, padding, dilation=1):
    k = pair(kernel_size)
    s = pair(stride) if stride else k  # an empty stride means the kernel size
    return k, s, pair(padding), pair(dilation)


def _windows(x, k, s, p, d, out_hw, fill):
    """Every tap of each 2-d pooling window, as [..., OH, OW, kh * kw] in row-major window order.
    Taps on the padding, and past the input where ceil_mode adds a partial window, are `fill`."""
    h, w = x.shape[-2:]
    oh, ow = out_hw
    hi = [
        max(0, (o - 1) * st + dd * (kk - 1) + 1 - n - pp)
        for o, st, dd, kk, n, pp in zip((oh, ow), s, d, k, (h, w), p, strict=True)
    ]
    config = [(0, 0, 0)] * (x.ndim - 2) + [(p[0], hi[0], 0), (p[1], hi[1], 0)]
    padded = jax.lax.pad(x, jnp.asarray(fill, x.dtype), config)
    taps = []
    for i in range(k[0]):
        for j in range(k[1]):
            r0, c0 = i * d[0], j * d[1]
            taps.append(
                padded[
                    ..., r0 : r0 + (oh - 1) * s[0] + 1 : s[0], c0 : c0 + (ow - 1) * s[1] + 1 : s[1]
                ]
            )
    return jnp.stack(taps, axis=-1)


@RULES.register("aten.max_pool2d_with_indices.default")
def max_pool2d_with_indices(ctx, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    k, s, p, d = _pool_args(x, kernel_size, stride, padding, dilation)
    oh, ow = out_shape(ctx)[-2:]
    lowest = -jnp.inf if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.iinfo(x.dtype).min
    taps = _windows(x, k, s, p, d, (oh, ow), lowest)
    tap = jnp.argmax(taps, axis=-1)  # first maximum in window order, like torch
    values = jnp.max(taps, axis=-1)
    # the tap's position in the unpadded input plane, flattened as h * W + w
    row = jnp.arange(oh)[:, None] * s[0] - p[0] + (tap // k[1]) * d[0]
    col = jnp.arange(ow)[None, :] * s[1] - p[1] + (tap % k[1]) * d[1]
    return values, (row * x.shape[-1] + col).astype(out_dtype(ctx, 1))


@RULES.register("aten.max_pool2d_with_indices_backward.default")
def max_pool2d_with_indices_backward(
    ctx, grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices
):
    # each output's grad is added to the input element its index names
    lead = x.shape[:-2]
    planes = math.prod(lead)
    g = grad.reshape(planes, -1)
    idx = indices.reshape(planes, -1)
    plane = jax.lax.broadcasted_iota(idx.dtype, idx.shape, 0)
    out = jnp.zeros((planes, x.shape[-2] * x.shape[-1]), opmath(x.dtype))
    out = out.at[plane, idx].add(g.astype(out.dtype))
    return out.reshape(x.shape).astype(out_dtype(ctx))


def _avg_divisor(hw, out_hw, k, s, p, count_include_pad):
    """torch's per-window divisor: the window clipped to the padded input (count_include_pad)
    or to the input itself. Static shapes make it a constant."""
    divs = []
    for n, o, kk, st, pp in zip(hw, out_hw, k, s, p, strict=True):
        start = np.arange(o) * st - pp
        end = np.minimum(start + kk, n + pp)
        size = end - start
        if not count_include_pad:
            size = np.minimum(end, n) - np.maximum(start, 0)
        divs.append(size)
    return np.outer(divs[0], divs[1])


def _avg_pool2d(x, out_hw, kernel_size, stride, padding, count_include_pad, divisor):
    # ceil_mode is already in out_hw (the recorded output size)
    k, s, p, _ = _pool_args(x, kernel_size, stride, padding)
    compute = opmath(x.dtype)
    total = jnp.sum(_windows(x.astype(compute), k, s, p, (1, 1), out_hw, 0), axis=-1)
    if divisor is None:
        divisor = _avg_divisor(x.shape[-2:], out_hw, k, s, p, count_include_pad)
    return pool_mean(total, divisor, compute).astype(x.dtype)


def pool_mean(total, divisor, compute):
    """A window's mean: total / divisor, truncated toward zero for integers as torch's integer
    kernels divide (the C++ `/`)."""
    divisor = jnp.asarray(divisor, compute)
    if jnp.issubdtype(compute, jnp.integer):
        return jax.lax.div(total, jnp.broadcast_to(divisor, total.shape))
    return total / divisor


@RULES.register("aten.avg_pool2d.default")
def avg_pool2d(
    ctx,
    x,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    out_hw = out_shape(ctx)[-2:]
    return _avg_pool2d(x, out_hw, kernel_size, stride, padding, count_include_pad, divisor_override)


@RULES.register("aten.avg_pool2d_backward.default")
def avg_pool2d_backward(
    ctx, grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
):
    def forward(inp):
        return _avg_pool2d(
            inp,
            grad.shape[-2:],
            kernel_size,
            stride,
            padding,
            count_include_pad,
            divisor_override,
        )

    _, vjp = jax.vjp(forward, x)
    return vjp(grad.astype(x.dtype))[0]


def adaptive_matrix(n: int, o: int) -> np.ndarray:
    """[o, n] 0/1 window membership: window i spans [floor(i*n/o), ceil((i+1)*n/o))."""
    m = np.zeros((o, n))
    for i in range(o):
        m[i, (i * n) // o : -(-(i + 1) * n // o)] = 1
    return m


def _adaptive_avg_pool2d(x, output_size):
    oh, ow = pair(output_size)
    compute = opmath(x.dtype)
    mh = adaptive_matrix(x.shape[-2], oh)
    mw = adaptive_matrix(x.shape[-1], ow)
    xf = x.astype(compute)
    total = jnp.einsum(
        "...hw,ph,qw->...pq",
        xf,
        jnp.asarray(mh, compute),
        jnp.asarray(mw, compute),
        precision=PRECISION,
    )
    counts = np.outer(mh.sum(1), mw.sum(1))
    return (total / jnp.asarray(counts, compute)).astype(x.dtype)


@RULES.register("aten._adaptive_avg_pool2d.default")
def adaptive_avg_pool2d(ctx, x, output_size):
    return _adaptive_avg_pool2d(x, output_size)


@RULES.register("aten._adaptive_avg_pool2d_backward.default")
def adaptive_avg_pool2d_backward(ctx, grad, x):
    _, vjp = jax.vjp(lambda inp: _adaptive_avg_pool2d(inp, grad.shape[-2:]), x)
    return vjp(grad.astype(x.dtype))[0]


# --------------------------------------------------------------------------- batch norm


def _channel(v, ndim):
    """A per-channel [C] vector shaped to broadcast against an [N, C, ...] input."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _bn_apply(x, mean, invstd, weight, bias):
    # torch's CPU kernel: y = x * alpha + beta, alpha = invstd * w, beta = b - mean * alpha
    alpha = invstd if weight is None else invstd * weight.astype(invstd.dtype)
    beta = -mean * alpha if bias is None else bias.astype(alpha.dtype) - mean * alpha
    return x * _channel(alpha, x.ndim) + _channel(beta, x.ndim)


def _empty_stats(ctx, *indices):
    return tuple(jnp.zeros(out_shape(ctx, i), out_dtype(ctx, i)) for i in indices)


@RULES.register("aten._native_batch_norm_legit_no_training.default")
def batch_norm_no_training(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
    compute = opmath(x.dtype)
    invstd = 1 / jnp.sqrt(running_var.astype(compute) + eps)
    y = _bn_apply(x.astype(compute), running_mean.astype(compute), invstd, weight, bias)
    return (y.astype(out_dtype(ctx)), *_empty_stats(ctx, 1, 2))


def _batch_stats(x):
    """(mean, sum of squared deviations, count) per channel over N and the spatial dims."""
    dims = (0, *range(2, x.ndim))
    xf = x.astype(opmath(x.dtype))
    n = xf.size // xf.shape[1]
    mean = jnp.sum(xf, axis=dims) / n
    return mean, jnp.sum(jnp.square(xf - _channel(mean, x.ndim)), axis=dims), n


@RULES.register("aten._native_batch_norm_legit_functional.default")
def batch_norm_functional(ctx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    # -> (y, save_mean, save_invstd, new_running_mean, new_running_var); in training the running
    # stats move toward the batch's: (1 - momentum) * old + momentum * new (unbiased variance)
    compute = opmath(x.dtype)
    if not training:
        y, *_ = batch_norm_no_training(
            ctx, x, weight, bias, running_mean, running_var, momentum, eps
        )
        return (y, *_empty_stats(ctx, 1, 2), running_mean, running_var)
    mean, var_sum, n = _batch_stats(x)
    # torch's kernel (bfloat16 with bfloat16 weights: bit for bit) stores the batch mean and
    # sum of squared deviations in the parameters' dtype, and invstd comes from the stored sum
    # divided by the count in that dtype; y = x * alpha + beta from the stored statistics
    stats = out_dtype(ctx, 1)
    mean = rounded(mean, stats)
    biased = rounded(rounded(var_sum, stats) / n, stats)
    invstd = rounded(1 / jnp.sqrt(biased + eps), out_dtype(ctx, 2))
    y = _bn_apply(x.astype(compute), mean, invstd, weight, bias)
    rm, rv = running_mean.astype(compute), running_var.astype(compute)
    # the running variance blends the unbiased variance of the unrounded sum, in its own dtype
    unbiased = rounded(var_sum / max(n - 1, 1), running_var.dtype)
    new_rm = momentum * mean + (1 - momentum) * rm
    new_rv = momentum * unbiased + (1 - momentum) * rv
    return (
        y.astype(out_dtype(ctx)),
        mean.astype(stats),
        invstd.astype(out_dtype(ctx, 2)),
        # the kernel writes its running stats' dtype, where torch's meta function may declare
        # float32 (bfloat16 stats under instance_norm): rounded as the kernel, then cast
        rounded(new_rm, running_mean.dtype).astype(out_dtype(ctx, 3)),
        rounded(new_rv, running_var.dtype).astype(out_dtype(ctx, 4)),
    )


@RULES.register("aten.native_batch_norm_backward.default")
def batch_norm_backward(
    ctx, grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask
):
    compute = opmath(x.dtype)
    g, xf = grad.astype(compute), x.astype(compute)
    dims = (0, *range(2, x.ndim))
    if train:
        mean, invstd = save_mean.astype(compute), save_invstd.astype(compute)
    else:
        mean = running_mean.astype(compute)
        invstd = 1 / jnp.sqrt(running_var.astype(compute) + eps)
    w = jnp.ones_like(invstd) if weight is None else weight.astype(compute)
    centered = xf - _channel(mean, x.ndim)
    grad_sum = jnp.sum(g, axis=dims)
    dot = jnp.sum(g * centered, axis=dims)
    dx = dw = db = None
    if mask[0]:
        if train:
            n = x.size // x.shape[1]
            proj = centered * _channel(dot / n * invstd * invstd, x.ndim)
            dx = (g - proj - _channel(grad_sum / n, x.ndim)) * _channel(invstd * w, x.ndim)
        else:
            dx = g * _channel(invstd * w, x.ndim)
        dx = dx.astype(out_dtype(ctx, 0))
    if mask[1]:
        dw = (dot * invstd).astype(out_dtype(ctx, 1))
    if mask[2]:
        db = grad_sum.astype(out_dtype(ctx, 2))
    return dx, dw, db


# --------------------------------------------------------------------------- layer norm


def layer_norm_stats(x, normalized_shape, eps):
    """(mean, rstd) over the trailing normalized dims (kept as size 1), in opmath."""
    dims = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    xf = x.astype(opmath(x.dtype))
    mean = jnp.mean(xf, axis=dims, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=dims, keepdims=True)
    return mean, 1 / jnp.sqrt(var + eps)


def layer_norm_apply(x, mean, rstd, weight, bias):
    # torch's CPU kernel: (x * rstd + (-rstd * mean)) * weight + bias, in opmath
    y = x.astype(mean.dtype) * rstd + (-rstd * mean)
    if weight is not None:
        y = y * weight.astype(y.dtype)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    return y


@RULES.register("aten.native_layer_norm.default")
def native_layer_norm(ctx, x, normalized_shape, weight, bias, eps):
    mean, rstd = layer_norm_stats(x, normalized_shape, eps)
    y = layer_norm_apply(x, mean, rstd, weight, bias)
    return y.astype(out_dtype(ctx)), mean.astype(out_dtype(ctx, 1)), rstd.astype(out_dtype(ctx, 2))


@RULES.register("aten.native_layer_norm_backward.default")
def native_layer_norm_backward(ctx, grad, x, normalized_shape, mean, rstd, weight, bias, mask):
    # xhat = (x - mean) * rstd, gw = grad * weight:
    # dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat));
    # dweight = sum(grad * xhat) and dbias = sum(grad) over the batch dims
    compute = opmath(x.dtype)
    axis = x.ndim - len(normalized_shape)
    norm_dims = tuple(range(axis, x.ndim))
    batch_dims = tuple(range(axis))
    g, rstd = grad.astype(compute), rstd.astype(compute)
    xhat = (x.astype(compute) - mean.astype(compute)) * rstd
    gw = g if weight is None else g * weight.astype(compute)
    dx = dw = db = None
    if mask[0]:
        mean_gw = jnp.mean(gw, axis=norm_dims, keepdims=True)
        mean_gwx = jnp.mean(gw * xhat, axis=norm_dims, keepdims=True)
        dx = (rstd * (gw - mean_gw - xhat * mean_gwx)).astype(out_dtype(ctx, 0))
    if mask[1] and weight is not None:
        dw = jnp.sum(g * xhat, axis=batch_dims).astype(out_dtype(ctx, 1))
    if mask[2] and bias is not None:
        db = jnp.sum(g, axis=batch_dims).astype(out_dtype(ctx, 2))
    return dx, dw, db


# --------------------------------------------------------------------------- group norm


@RULES.register("aten.native_group_norm.default")
def native_group_norm(ctx, x, weight, bias, n, c, hxw, group, eps):
    # torch's CPU kernel, per (sample, group) of C / group channels: mean and rstd over the
    # group's channels and spatial positions; then (x - mean) * rstd without weight and bias,
    # else y = x * scale + shift per channel with scale = rstd * weight (1 when None) and
    # shift = -scale * mean + bias (0 when None); in opmath, rounded once
    compute = opmath(x.dtype)
    n, c, hxw = x.shape[0], x.shape[1], math.prod(x.shape[2:])  # the array's (static) sizes
    d = c // group
    xg = x.astype(compute).reshape(n, group, d, hxw)
    mean = jnp.mean(xg, axis=(2, 3))
    var = jnp.mean(jnp.square(xg - mean[:, :, None, None]), axis=(2, 3))
    rstd = 1 / jnp.sqrt(jnp.maximum(var, 0) + eps)
    stats = (mean.astype(out_dtype(ctx, 1)), rstd.astype(out_dtype(ctx, 2)))
    if weight is None and bias is None:
        y = (xg - mean[:, :, None, None]) * rstd[:, :, None, None]
        return (y.reshape(x.shape).astype(out_dtype(ctx)), *stats)
    scale = jnp.broadcast_to(rstd[:, :, None], (n, group, d))
    if weight is not None:
        scale = scale * weight.astype(compute).reshape(group, d)
    shift = -scale * mean[:, :, None]
    if bias is not None:
        shift = shift + bias.astype(compute).reshape(group, d)
    y = xg * scale[..., None] + shift[..., None]
    return (y.reshape(x.shape).astype(out_dtype(ctx)), *stats)
