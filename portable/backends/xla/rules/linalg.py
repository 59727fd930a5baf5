"""Linear algebra (opset family `linalg`): factorizations, solves, inverses, determinants.
Registered for `xla` alone (names.LINALG): neuronx-cc has no factorization ops.

XLA:CPU runs the factorizations with LAPACK (getrf, potrf, geqrf/orgqr, gesdd, syevd), as torch's
CPU kernels do, so the deterministic results (LU with its partial pivoting, Cholesky, QR with
LAPACK's Householder sign convention) agree with torch's to float32 rounding of the factorization.
Two results are unique only up to a gauge: singular vectors (U's columns with Vh's rows) and
symmetric eigenvectors, each up to sign; jaxlib's LAPACK and torch's MKL pick different signs, so
the parity comparison aligns those outputs' signs before comparing (portable/testing/gauge.py).

A compiled program does not raise on a singular or non-positive-definite input as eager does:
the factorization's `info` output says so (LAPACK's code: for LU the first zero pivot, for
Cholesky the order of the first leading minor that is not positive definite), the other results
are then unspecified (capture/decompositions.py `without_error_checks`).

Factorizations are computed in float32 for float32/bfloat16/float16 inputs (torch refuses half
types for them) and never in float64, unless the input is float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# geqrf, householder_product (orgqr) and ormqr: JAX's LAPACK-backed primitives, not re-exported
# by jax.lax.linalg
from jax._src.lax import linalg as lax_linalg

from . import RULES
from ._util import PRECISION, opmath, out_dtype, out_shape, unsupported


def _f(x):
    """x in the dtype the factorization runs in (float32 for half types)."""
    return x.astype(opmath(x.dtype))


def _mm(a, b):
    return jnp.matmul(a, b, precision=PRECISION)


def _mT(x):  # noqa: N802 (torch's name)
    return jnp.swapaxes(x, -1, -2)


def _empty(ctx, index):
    """A result the op's flags did not ask for (torch returns an empty tensor)."""
    return jnp.zeros(out_shape(ctx, index), out_dtype(ctx, index))


def _broadcast_batch(a, b):
    """A [..., m, m] and B [..., m, k] with their batch dims broadcast (torch's solve rule)."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:])


# --------------------------------------------------------------------------- LU


def _lu(a):
    """getrf: (LU, 1-based int32 pivots, int32 info = first zero pivot, 1-based, or 0)."""
    lu, pivots, _ = jax.lax.linalg.lu(a)
    k = min(a.shape[-2:])
    if k == 0:
        return lu, pivots.astype(jnp.int32), jnp.zeros(a.shape[:-2], jnp.int32)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k]
    zero = diag == 0
    first = jnp.argmax(zero, axis=-1).astype(jnp.int32) + 1
    info = jnp.where(jnp.any(zero, axis=-1), first, jnp.zeros_like(first))
    return lu, (pivots + 1).astype(jnp.int32), info


def _permutation(pivots, m):
    """The row permutation (as indices) that LAPACK's 1-based row swaps `pivots` apply: row i of
    P^T A is row perm[i] of A."""
    batch = pivots.shape[:-1]
    perm = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), batch + (m,))

    def swap(i, perm):
        j = pivots[..., i] - 1
        pi = perm[..., i]
        pj = jnp.take_along_axis(perm, j[..., None], axis=-1)[..., 0]
        perm = perm.at[..., i].set(pj)
        onehot = jnp.arange(m, dtype=jnp.int32) == j[..., None]
        return jnp.where(onehot, pi[..., None], perm)

    return jax.lax.fori_loop(0, pivots.shape[-1], swap, perm) if pivots.shape[-1] else perm


def _perm_sign(pivots, dtype):
    """The determinant of the permutation: (-1) ** (number of actual swaps)."""
    idx = jnp.arange(1, pivots.shape[-1] + 1, dtype=pivots.dtype)
    swaps = jnp.sum(pivots != idx, axis=-1)
    return jnp.where(swaps % 2 == 1, jnp.asarray(-1, dtype), jnp.asarray(1, dtype))


def _unpack(lu, pivots, dtype):
    """(P, L, U) from the packed LU and its pivots: A = P @ L @ U."""
    m, n = lu.shape[-2:]
    k = min(m, n)
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper = jnp.triu(lu[..., :k, :])
    perm = _permutation(pivots, m)
    # P^T A = L U with P^T's row i = e_{perm[i]}: P[perm[i], i] = 1
    p = (perm[..., None, :] == jnp.arange(m, dtype=perm.dtype)[:, None]).astype(dtype)
    return p, lower.astype(dtype), upper.astype(dtype)


@RULES.register("aten.linalg_lu_factor_ex.default", platform="xla")
def linalg_lu_factor_ex(ctx, a, *, pivot=True, check_errors=False):
    if not pivot:
        raise unsupported(ctx, "LU without pivoting", "use pivot=True (torch's CPU kernel too)")
    lu, pivots, info = _lu(_f(a))
    return lu.astype(a.dtype), pivots, info


@RULES.register("aten.linalg_lu.default", platform="xla")
def linalg_lu(ctx, a, *, pivot=True):
    if not pivot:
        raise unsupported(ctx, "LU without pivoting", "use pivot=True (torch's CPU kernel too)")
    lu, pivots, _ = _lu(_f(a))
    return _unpack(lu, pivots, a.dtype)


@RULES.register("aten.lu_unpack.default", platform="xla")
def lu_unpack(ctx, lu, pivots, unpack_data=True, unpack_pivots=True):
    p, lower, upper = _unpack(lu, pivots.astype(jnp.int32), lu.dtype)
    return (
        p if unpack_pivots else _empty(ctx, 0),
        lower if unpack_data else _empty(ctx, 1),
        upper if unpack_data else _empty(ctx, 2),
    )


def _lu_solve(lu, pivots, b, adjoint):
    """X with A X = B (A^T X = B when adjoint) from A's packed LU; b [..., m, k]."""
    lu, b = _broadcast_batch(lu, b)
    batch = b.shape[:-2]
    perm = jnp.broadcast_to(_permutation(pivots, lu.shape[-1]), batch + lu.shape[-1:])
    tri = jax.lax.linalg.triangular_solve
    if not adjoint:
        pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        y = tri(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return tri(lu, y, left_side=True, lower=False)
    # A^T = U^T L^T P^T: solve U^T y = B, L^T z = y, then X = P z
    y = tri(lu, b, left_side=True, lower=False, transpose_a=True)
    z = tri(lu, y, left_side=True, lower=True, unit_diagonal=True, transpose_a=True)
    inverse = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inverse[..., :, None], axis=-2)


@RULES.register("aten.linalg_lu_solve.default", platform="xla")
def linalg_lu_solve(ctx, lu, pivots, b, *, left=True, adjoint=False):
    dtype = out_dtype(ctx)
    lu, b = _f(lu), _f(b)
    if left:
        return _lu_solve(lu, pivots, b, adjoint).astype(dtype)
    # X A = B <=> A^T X^T = B^T
    return _mT(_lu_solve(lu, pivots, _mT(b), not adjoint)).astype(dtype)


def _vector_rhs(a, b, left):
    """torch's linalg_solve_is_vector_rhs: B is a (batch of) vector(s)."""
    return b.ndim == 1 or (left and b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])


@RULES.register("aten._linalg_solve_ex.default", platform="xla")
def linalg_solve_ex(ctx, a, b, *, left=True, check_errors=False):
    dtype = out_dtype(ctx)
    vector = _vector_rhs(a, b, left)
    a32, b32 = _f(a), _f(b)
    if vector:
        b32 = b32[..., None]
    lu, pivots, info = _lu(a32)
    if left:
        x = _lu_solve(lu, pivots, b32, False)
    else:
        x = _mT(_lu_solve(lu, pivots, _mT(b32), True))
    if vector:
        x = x[..., 0]
    return x.astype(dtype), lu.astype(a.dtype), pivots, info


@RULES.register("aten.linalg_inv_ex.default", platform="xla")
def linalg_inv_ex(ctx, a, *, check_errors=False):
    a32 = _f(a)
    lu, pivots, info = _lu(a32)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a32.dtype), a32.shape)
    return _lu_solve(lu, pivots, eye, False).astype(a.dtype), info


# det and slogdet factor A^T (torch's kernel passes A's row-major storage to column-major
# getrf): the LU and pivots they return are A^T's; det A^T = det A


@RULES.register("aten._linalg_det.default", platform="xla")
def linalg_det(ctx, a):
    lu, pivots, _ = _lu(_mT(_f(a)))
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    det = _perm_sign(pivots, lu.dtype) * jnp.prod(diag, axis=-1)
    return det.astype(a.dtype), lu.astype(a.dtype), pivots


@RULES.register("aten._linalg_slogdet.default", platform="xla")
def linalg_slogdet(ctx, a):
    lu, pivots, _ = _lu(_mT(_f(a)))
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    sign = _perm_sign(pivots, lu.dtype) * jnp.prod(jnp.sign(diag), axis=-1)
    logabs = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return sign.astype(a.dtype), logabs.astype(a.dtype), lu.astype(a.dtype), pivots


# --------------------------------------------------------------------------- Cholesky


def _cholesky_info(a):
    """potrf's info: the order of the first leading minor that is not positive definite (its
    pivot a_jj - sum_k l_jk^2 is <= 0 or NaN), 0 when there is none; the right-looking
    recurrence, one column per step."""
    n = a.shape[-1]

    def step(j, carry):
        low, info = carry
        row = low[..., j, :]
        pivot = a[..., j, j] - jnp.sum(row * row, axis=-1)
        bad = ~(pivot > 0)
        info = jnp.where((info == 0) & bad, j + 1, info)
        safe = jnp.where(bad, jnp.ones_like(pivot), pivot)
        ljj = jnp.sqrt(safe)
        col = (a[..., :, j] - _mm(low, row[..., :, None])[..., 0]) / ljj[..., None]
        below = jnp.arange(n) > j
        col = jnp.where(below, col, jnp.where(jnp.arange(n) == j, ljj[..., None], 0))
        return low.at[..., :, j].set(col), info

    info = jnp.zeros(a.shape[:-2], jnp.int32)
    if n == 0:
        return info
    return jax.lax.fori_loop(0, n, step, (jnp.zeros_like(a), info))[1]


def _cholesky(a, upper):
    """L (or U = L^T) from A's lower (upper) triangle, as potrf reads only that triangle."""
    sym = _mT(a) if upper else a
    low = jax.lax.linalg.cholesky(sym, symmetrize_input=False)
    return (_mT(low) if upper else low), sym


@RULES.register("aten.linalg_cholesky_ex.default", platform="xla")
def linalg_cholesky_ex(ctx, a, *, upper=False, check_errors=False):
    factor, sym = _cholesky(_f(a), upper)
    info = _cholesky_info(jnp.tril(sym) + _mT(jnp.tril(sym, -1)))
    return factor.astype(a.dtype), info


@RULES.register("aten.cholesky.default", platform="xla")
def cholesky(ctx, a, upper=False):
    return _cholesky(_f(a), upper)[0].astype(a.dtype)


def _lower_factor(factor, upper):
    """L from the factor argument of cholesky_solve / cholesky_inverse (U = L^T when upper);
    only its triangle is read."""
    return jnp.tril(_mT(factor)) if upper else jnp.tril(factor)


@RULES.register("aten.cholesky_solve.default", platform="xla")
def cholesky_solve(ctx, b, factor, upper=False):
    dtype = out_dtype(ctx)
    low, b32 = _broadcast_batch(_lower_factor(_f(factor), upper), _f(b))
    tri = jax.lax.linalg.triangular_solve
    y = tri(low, b32, left_side=True, lower=True)
    return tri(low, y, left_side=True, lower=True, transpose_a=True).astype(dtype)


@RULES.register("aten.cholesky_inverse.default", platform="xla")
def cholesky_inverse(ctx, factor, upper=False):
    low = _lower_factor(_f(factor), upper)
    eye = jnp.broadcast_to(jnp.eye(low.shape[-1], dtype=low.dtype), low.shape)
    tri = jax.lax.linalg.triangular_solve
    y = tri(low, eye, left_side=True, lower=True)
    return tri(low, y, left_side=True, lower=True, transpose_a=True).astype(factor.dtype)


# --------------------------------------------------------------------------- triangular solves


@RULES.register("aten.linalg_solve_triangular.default", platform="xla")
def linalg_solve_triangular(ctx, a, b, *, upper, left=True, unitriangular=False):
    dtype = out_dtype(ctx)
    a32, b32 = _broadcast_batch(_f(a), _f(b))
    x = jax.lax.linalg.triangular_solve(
        a32, b32, left_side=left, lower=not upper, unit_diagonal=unitriangular
    )
    return x.astype(dtype)


@RULES.register("aten.triangular_solve.default", platform="xla")
def triangular_solve(ctx, b, a, upper=True, transpose=False, unitriangular=False):
    a32, b32 = _broadcast_batch(_f(a), _f(b))
    x = jax.lax.linalg.triangular_solve(
        a32,
        b32,
        left_side=True,
        lower=not upper,
        transpose_a=transpose,
        unit_diagonal=unitriangular,
    )
    return x.astype(out_dtype(ctx, 0)), a32.astype(out_dtype(ctx, 1))


# --------------------------------------------------------------------------- QR, SVD, eigh


@RULES.register("aten.linalg_qr.default", platform="xla")
def linalg_qr(ctx, a, mode="reduced"):
    q, r = jax.lax.linalg.qr(_f(a), full_matrices=mode == "complete")
    q = _empty(ctx, 0) if mode == "r" else q.astype(a.dtype)
    return q, r.astype(a.dtype)


@RULES.register("aten._linalg_svd.default", platform="xla")
def linalg_svd(ctx, a, full_matrices=False, compute_uv=True, *, driver=None):
    a32 = _f(a)
    if not compute_uv:
        s = jax.lax.linalg.svd(a32, full_matrices=False, compute_uv=False)
        return _empty(ctx, 0), s.astype(out_dtype(ctx, 1)), _empty(ctx, 2)
    u, s, vh = jax.lax.linalg.svd(a32, full_matrices=full_matrices, compute_uv=True)
    return u.astype(a.dtype), s.astype(out_dtype(ctx, 1)), vh.astype(a.dtype)


@RULES.register("aten._linalg_eigh.default", platform="xla")
def linalg_eigh(ctx, a, UPLO="L", compute_v=True):  # noqa: N803 (torch's argument name)
    v, w = jax.lax.linalg.eigh(_f(a), lower=UPLO == "L", symmetrize_input=False)
    values = w.astype(out_dtype(ctx, 0))
    return values, (v.astype(a.dtype) if compute_v else _empty(ctx, 1))


# --------------------------------------------------------------------------- Householder


@RULES.register("aten.geqrf.default", platform="xla")
def geqrf(ctx, a):
    reflectors, tau = lax_linalg.geqrf(_f(a))
    return reflectors.astype(a.dtype), tau.astype(a.dtype)


@RULES.register("aten.linalg_householder_product.default", platform="xla")
def linalg_householder_product(ctx, a, tau):
    return lax_linalg.householder_product(_f(a), _f(tau)).astype(out_dtype(ctx))


@RULES.register("aten.ormqr.default", platform="xla")
def ormqr(ctx, a, tau, c, left=True, transpose=False):
    a32, c32 = _broadcast_batch(_f(a), _f(c))
    tau32 = jnp.broadcast_to(_f(tau), a32.shape[:-2] + tau.shape[-1:])
    out = lax_linalg.ormqr(a32, tau32, c32, left=left, transpose=transpose)
    return out.astype(out_dtype(ctx))
