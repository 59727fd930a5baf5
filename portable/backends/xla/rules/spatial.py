"""Spatial and pairwise ops (opset family `spatial`): grid sampling, antialiased and 3-d
resampling, pairwise distances, bilinear forms, embedding bags, matrix-vector products.

Each follows the order of torch's CPU kernel where the order changes the rounding: addbmm adds
one batch's product at a time into the result, cdist takes the matmul form for p = 2 where the
kernel does, and the distance gradients are the kernel's per-element formulas.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import RULES
from ._util import PRECISION, matmul, opmath, out_dtype, out_shape, scalar_like, unsupported

# --------------------------------------------------------------------------- matrix products


def _scaled(value, factor, dtype):
    return value if factor == 1 else value * jnp.asarray(factor, dtype)


@RULES.register("aten.addmv.default")
def addmv(ctx, x, mat, vec, *, beta=1, alpha=1):
    # beta * x + alpha * (mat @ vec) in opmath with beta and alpha in the dtype, rounded once
    # (torch's gemv); with beta == 0 x is ignored (even NaN), as in addmm
    dtype, shape = out_dtype(ctx), out_shape(ctx)
    acc = opmath(dtype)
    out = jnp.matmul(
        mat.astype(dtype), vec.astype(dtype), precision=PRECISION, preferred_element_type=acc
    )
    if alpha != 1:
        out = jnp.asarray(alpha, dtype).astype(acc) * out
    if beta != 0:
        term = x.astype(dtype).astype(acc)
        if beta != 1:
            term = jnp.asarray(beta, dtype).astype(acc) * term
        out = term + out
    return jnp.broadcast_to(out.astype(dtype), shape)


@RULES.register("aten.addbmm.default")
def addbmm(ctx, x, batch1, batch2, *, beta=1, alpha=1):
    # torch's kernel: result = beta * x + alpha * batch1[0] @ batch2[0], then
    # result += alpha * batch1[b] @ batch2[b] for each later b, rounded to dtype after each
    dtype, shape = out_dtype(ctx), out_shape(ctx)
    acc = opmath(dtype)
    start = jnp.zeros(shape, dtype) if beta == 0 else jnp.broadcast_to(x.astype(dtype), shape)
    if batch1.shape[0] == 0:
        return _scaled(start, beta, dtype)

    def product(b):
        mm = jnp.matmul(
            batch1[b].astype(dtype),
            batch2[b].astype(dtype),
            precision=PRECISION,
            preferred_element_type=acc,
        )
        return _scaled(mm, alpha, acc)

    first = product(0)
    if beta != 0:
        first = _scaled(start.astype(acc), beta, acc) + first

    def add(total, b):
        return (total.astype(acc) + product(b)).astype(dtype), None

    out, _ = jax.lax.scan(add, first.astype(dtype), jnp.arange(1, batch1.shape[0]))
    return out


@RULES.register("aten._trilinear.default")
def trilinear(ctx, i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    # out[d] = sum over sumdim of i1[d] * i2[d] * i3[d], each input unsqueezed at its expand
    # dims; torch sums i1 * i2 over the sumdims i3 lacks, then that times i3 over the rest
    # (summed dims stay, size 1)
    dtype = out_dtype(ctx)
    acc = opmath(dtype)
    rank = i1.ndim + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:rank]

    def subs(expand):
        return "".join(letters[d] for d in range(rank) if d not in set(expand))

    sum12 = {d for d in sumdim if d in set(expand3)}
    s1, s2, s3 = subs(expand1), subs(expand2), subs(expand3)
    s12 = "".join(c for c in letters if (c in s1 or c in s2) and letters.index(c) not in sum12)
    first = jnp.einsum(
        f"{s1},{s2}->{s12}",
        i1.astype(dtype),
        i2.astype(dtype),
        precision=PRECISION,
        preferred_element_type=acc,
    ).astype(dtype)
    kept = "".join(c for c in letters if (c in s12 or c in s3) and letters.index(c) not in sumdim)
    out = jnp.einsum(
        f"{s12},{s3}->{kept}",
        first,
        i3.astype(dtype),
        precision=PRECISION,
        preferred_element_type=acc,
    )
    return out.astype(dtype).reshape(out_shape(ctx))


# --------------------------------------------------------------------------- distances


def _norm(diff, p, axis):
    """The p-norm over `axis` of torch's distance kernels: the count of nonzeros for p = 0, the
    max for p = inf, sum(|d|^p)^(1/p) otherwise (sqrt for 2, no root for 1)."""
    if p == 0:
        return jnp.sum((diff != 0).astype(diff.dtype), axis=axis)
    if p == math.inf:
        return jnp.max(jnp.abs(diff), axis=axis, initial=0)
    if p == 1:
        return jnp.sum(jnp.abs(diff), axis=axis)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=axis))
    return jnp.sum(jnp.abs(diff) ** p, axis=axis) ** (1 / p)


@RULES.register("aten.dist.default")
def dist(ctx, x, other, p=2):
    # norm(x - other, p): the difference rounded to the dtype, the norm in opmath
    dtype = out_dtype(ctx)
    diff = (x.astype(dtype) - other.astype(dtype)).astype(opmath(dtype)).reshape(-1)
    if p == -math.inf:
        return jnp.min(jnp.abs(diff)).astype(dtype)
    return _norm(diff, p, 0).astype(dtype)


def _euclidean(x1, x2, dtype):
    # torch's _euclidean_dist: [-2 x1, |x1|^2, 1] @ [x2, 1, |x2|^2]^T, clamped at 0, sqrt
    n1 = jnp.sum(x1 * x1, axis=-1, keepdims=True)
    n2 = jnp.sum(x2 * x2, axis=-1, keepdims=True)
    a = jnp.concatenate([x1 * jnp.asarray(-2, dtype), n1, jnp.ones_like(n1)], axis=-1)
    b = jnp.concatenate([x2, jnp.ones_like(n2), n2], axis=-1)
    return jnp.sqrt(jnp.maximum(matmul(a, jnp.swapaxes(b, -1, -2), dtype), 0))


@RULES.register("aten._cdist_forward.default")
def cdist_forward(ctx, x1, x2, p, compute_mode=None):
    dtype, shape = out_dtype(ctx), out_shape(ctx)
    r1, r2 = x1.shape[-2], x2.shape[-2]
    if 0 in shape:
        return jnp.zeros(shape, dtype)
    batch = shape[:-2]
    x1 = jnp.broadcast_to(x1.astype(dtype), batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2.astype(dtype), batch + x2.shape[-2:])
    mode = compute_mode or 0
    if p == 2 and (mode == 1 or (mode == 0 and (r1 > 25 or r2 > 25))):
        return _euclidean(x1, x2, dtype)
    acc = opmath(dtype)
    diff = x1[..., :, None, :].astype(acc) - x2[..., None, :, :].astype(acc)
    return _norm(diff, p, -1).astype(dtype)


def _distance_grad(diff, grad, dist, p):
    """Each element's gradient contribution in torch's distance backward kernels, from the
    difference, the distance's grad and the distance (0 where the distance is 0)."""
    sign = jnp.sign(diff)
    zero = jnp.zeros_like(diff)
    if p == 1:
        return grad * sign
    if p == math.inf:
        return jnp.where(jnp.abs(diff) == dist, grad * sign, zero)
    if p == 2:
        return jnp.where(dist == 0, zero, grad * diff / dist)
    if p < 2:
        out = sign * jnp.abs(diff) ** (p - 1) * grad / dist ** (p - 1)
        out = jnp.where(dist == 0, zero, out)
        return jnp.where((diff == 0) & (p < 1), zero, out)
    out = diff * jnp.abs(diff) ** (p - 2) * grad / dist ** (p - 1)
    return jnp.where(dist == 0, zero, out)


def _pair_grad(grad, x1, x2, dist, p, dtype):
    # sum over the rows j of x2 of the contribution of (x1[i] - x2[j]) to x1[i]'s gradient
    acc = opmath(dtype)
    diff = x1[..., :, None, :].astype(acc) - x2[..., None, :, :].astype(acc)
    g = grad.astype(acc)[..., None]
    d = dist.astype(acc)[..., None]
    return jnp.sum(_distance_grad(diff, g, d, p), axis=-2)


@RULES.register("aten._cdist_backward.default")
def cdist_backward(ctx, grad, x1, x2, p, cdist):
    dtype, shape = out_dtype(ctx), out_shape(ctx)
    if p == 0 or 0 in shape or 0 in x2.shape or 0 in grad.shape:
        return jnp.zeros(shape, dtype)
    out = _pair_grad(grad, x1, x2, cdist, p, dtype)
    return jnp.broadcast_to(out, shape).astype(dtype)


def _pairs(n):
    rows, cols = np.triu_indices(n, 1)
    return jnp.asarray(rows, np.int32), jnp.asarray(cols, np.int32)


@RULES.register("aten._pdist_forward.default")
def pdist_forward(ctx, x, p=2):
    # the distances of rows i < j, in row-major order of (i, j)
    dtype, shape = out_dtype(ctx), out_shape(ctx)
    n = x.shape[0]
    if 0 in shape:
        return jnp.zeros(shape, dtype)
    rows, cols = _pairs(n)
    acc = opmath(dtype)
    diff = jnp.take(x, rows, axis=0).astype(acc) - jnp.take(x, cols, axis=0).astype(acc)
    return _norm(diff, p, -1).astype(dtype)


@RULES.register("aten._pdist_backward.default")
def pdist_backward(ctx, grad, x, p, pdist):
    # pair (i, j) adds its contribution c(x[i] - x[j]) to row i and -c to row j; c is odd in
    # the difference, so row i's gradient is the sum over j != i of c(x[i] - x[j]) with the
    # pair's grad and distance put in both [i, j] and [j, i]
    dtype, shape = out_dtype(ctx), out_shape(ctx)
    n = x.shape[0]
    if p == 0 or n < 2 or 0 in shape:
        return jnp.zeros(shape, dtype)
    rows, cols = _pairs(n)
    acc = opmath(dtype)

    def square(values):
        full = jnp.zeros((n, n), acc).at[rows, cols].set(values.astype(acc))
        return full + full.T

    return _pair_grad(square(grad), x, x, square(pdist), p, dtype).astype(dtype)


# --------------------------------------------------------------------------- grid sampling
# torch's source coordinates: the grid's [-1, 1] unnormalized to pixels, then clipped (border)
# or reflected and clipped (reflection). Each spatial dim d of the input reads grid component
# n - 1 - d (x is the last). 2-d takes the vectorized CPU kernel's arithmetic
# (GridSamplerKernel.cpp `ComputeLocationBase`), 3-d the scalar one's (GridSampler.h): they
# round differently, so each is followed where it differs.

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2


def _unnormalize(coord, size, align_corners, vectorized):
    if vectorized:  # (in + 1) * scale (- 0.5), scale (size - 1) / 2 or size / 2
        if align_corners:
            return (coord + 1) * scalar_like((size - 1) / 2, coord)
        return (coord + 1) * scalar_like(size / 2, coord) - scalar_like(0.5, coord)
    if align_corners:
        return (coord + 1) / 2 * scalar_like(size - 1, coord)
    return ((coord + 1) * scalar_like(size, coord) - 1) / 2


def _clip(coord, size):
    # clamp to [0, size - 1], NaN to 0; the borders count as clipped (gradient 0 there), as in
    # torch's backward kernels
    low = (coord <= 0) | jnp.isnan(coord)
    coord = jnp.where(low, jnp.zeros_like(coord), coord)
    return jnp.where(coord >= size - 1, jnp.full_like(coord, size - 1), coord)


def _reflect(coord, size, align_corners, vectorized):
    # reflected into [low, low + span]: low 0, span size - 1 (align_corners) or low -0.5, span
    # size; a span of 0 reflects everything to 0
    low, span = (0.0, size - 1) if align_corners else (-0.5, size)
    if span <= 0:
        return jnp.zeros_like(coord)
    if vectorized:  # |in - low| less its whole double spans, folded once: min(e, 2 span - e)
        twice = scalar_like(2 * span, coord)
        folded = jnp.abs(coord - scalar_like(low, coord))
        extra = folded - jnp.trunc(folded / twice) * twice
        return jnp.minimum(extra, twice - extra) + scalar_like(low, coord)
    low_, span_ = scalar_like(low, coord), scalar_like(span, coord)
    folded = jnp.abs(coord - low_)
    extra = jnp.fmod(folded, span_)
    even = jnp.fmod(jnp.floor(folded / span_), scalar_like(2, coord)) == 0
    return jnp.where(even, extra + low_, span_ - extra + low_)


def _pad_coordinate(coord, size, padding_mode, align_corners, vectorized):
    if padding_mode == _BORDER:
        return _clip(coord, size)
    if padding_mode == _REFLECTION:
        return _clip(_reflect(coord, size, align_corners, vectorized), size)
    return coord


class _Planes:
    """Reads of the input [N, C, *S] at integer pixel positions [N, *O] per spatial dim (as
    floats): 0 outside the input, as torch's within_bounds checks."""

    def __init__(self, x):
        self.n, self.c, self.sizes = x.shape[0], x.shape[1], x.shape[2:]
        self.flat = x.reshape(self.n, self.c, math.prod(self.sizes))

    def read(self, positions):
        valid = jnp.ones(positions[0].shape, bool)
        flat = jnp.zeros(positions[0].shape, jnp.int32)
        for pos, size in zip(positions, self.sizes, strict=True):
            valid = valid & (pos >= 0) & (pos <= size - 1)
            flat = flat * size + jnp.clip(pos, 0, size - 1).astype(jnp.int32)
        out_sizes = flat.shape[1:]
        index = jnp.where(valid, flat, 0).reshape(self.n, 1, -1)
        index = jnp.broadcast_to(index, (self.n, self.c, index.shape[-1]))
        values = jnp.take_along_axis(self.flat, index, axis=-1)
        values = values.reshape((self.n, self.c) + out_sizes)
        return jnp.where(valid[:, None], values, jnp.zeros_like(values))


def _grid_sample(x, grid, mode, padding_mode, align_corners):
    """grid_sampler_{2,3}d, bilinear or nearest, in x's dtype: x [N, C, *S], grid [N, *O, n]."""
    planes = _Planes(x)
    n = len(planes.sizes)
    vectorized = n == 2
    raw = [grid[..., n - 1 - d] for d in range(n)]
    coords = [
        _pad_coordinate(
            _unnormalize(c, s, align_corners, vectorized),
            s,
            padding_mode,
            align_corners,
            vectorized,
        )
        for c, s in zip(raw, planes.sizes, strict=True)
    ]
    if mode == _NEAREST:
        return planes.read([jax.lax.stop_gradient(jnp.round(c)) for c in coords])
    # (bi/tri)linear: the 2^n corners from the floors, added low corners first (x fastest),
    # each weighted by the product of its dims' weights: frac for the high side; 1 - frac for
    # the low one in 2-d (y's weight times x's), floor + 1 - coord in 3-d (x's times y's times
    # z's)
    floors = [jax.lax.stop_gradient(jnp.floor(c)) for c in coords]
    sides = []
    for c, f in zip(coords, floors, strict=True):
        frac = c - f
        sides.append((1 - frac if vectorized else (f + 1) - c, frac))
    out = None
    for corner in np.ndindex(*(2,) * n):
        dims = list(range(n)) if vectorized else list(reversed(range(n)))
        first, *rest = dims
        weight = sides[first][corner[first]]
        for d in rest:
            weight = weight * sides[d][corner[d]]
        term = (
            planes.read([f + high for f, high in zip(floors, corner, strict=True)])
            * weight[:, None]
        )
        out = term if out is None else out + term
    return out


def _sampler_mode(ctx, mode, padding_mode, align_corners, dims):
    if mode not in (_BILINEAR, _NEAREST, _BICUBIC) or (mode == _BICUBIC and dims == 3):
        raise ValueError(f"grid_sampler_{dims}d has no interpolation mode {mode}")
    if mode == _BICUBIC:
        # torch's build contracts the 16-tap sums and the cubic weights into FMAs; where the
        # taps cancel, float32 results then differ by 1e-4 relative (ONNX Runtime's too)
        raise unsupported(
            ctx,
            "bicubic grid sampling does not round as torch's kernel does (FMA-contracted sums)",
            "use mode='bilinear' or 'nearest', or run on `cpu`",
        )
    if dims == 3 and padding_mode == _REFLECTION and not align_corners:
        # fused by XLA:CPU, the unnormalized coordinate feeding fmod rounds an ulp away from
        # torch's scalar kernel, which far-outside grids amplify past float32 tolerance
        raise unsupported(
            ctx,
            "grid_sampler_3d with padding_mode='reflection' and align_corners=False does not "
            "round its source coordinates as torch's kernel does",
            "use align_corners=True or another padding mode, or run on `cpu`",
        )


@RULES.register("aten.grid_sampler_2d.default", "aten.grid_sampler_3d.default")
def grid_sampler(ctx, x, grid, interpolation_mode, padding_mode, align_corners):
    # in the input's dtype, half types too: torch's CPU kernel computes bfloat16 in bfloat16
    _sampler_mode(ctx, interpolation_mode, padding_mode, align_corners, x.ndim - 2)
    dtype = out_dtype(ctx)
    out = _grid_sample(
        x.astype(dtype), grid.astype(dtype), interpolation_mode, padding_mode, align_corners
    )
    return out.astype(dtype)


@RULES.register("aten.grid_sampler_2d_backward.default", "aten.grid_sampler_3d_backward.default")
def grid_sampler_backward(
    ctx, grad, x, grid, interpolation_mode, padding_mode, align_corners, output_mask
):
    # the vector-Jacobian product of the forward above: grad_input gathers each output's grad
    # back to its taps with their weights, grad_grid is the weights' derivative (0 for nearest)
    _sampler_mode(ctx, interpolation_mode, padding_mode, align_corners, x.ndim - 2)
    acc = out_dtype(ctx, 1)
    if jnp.dtype(acc) != jnp.dtype(opmath(acc)):
        # torch sums the half-type gradients in its own order, rounding after every add
        raise unsupported(
            ctx,
            f"{jnp.dtype(acc).name} grid sampler gradients round in torch's summation order",
            "train in float32, or run the backward on `cpu`",
        )

    def forward(inp, g):
        return _grid_sample(inp, g, interpolation_mode, padding_mode, align_corners)

    _, pullback = jax.vjp(forward, x.astype(acc), grid.astype(acc))
    grad_input, grad_grid = pullback(grad.astype(acc))
    results: list[jax.Array | None] = []
    for i, value in enumerate((grad_input, grad_grid)):
        spec = ctx.out[i] if isinstance(ctx.out, tuple) else None
        if spec is None:
            results.append(None)
            continue
        value = value if output_mask[i] else jnp.zeros_like(value)
        results.append(value.astype(out_dtype(ctx, i)))
    return tuple(results)
