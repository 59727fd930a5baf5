"""The `xla` rule table's cases for the opset family `linalg` (rules/linalg.py). Builders and
`Case` are in tests/xla_cases.py.

Tolerances: a float32 factorization or solve is not rounded once; its error is a few ulps times
the condition number and the size (LAPACK's backward-error bounds), and jaxlib's LAPACK blocks
and orders its sums differently from torch's MKL. The inputs here are well conditioned
(cond(A) < ~10: a shifted random matrix, an SPD matrix with a shifted spectrum), so 1e-5 relative
and absolute (~100 float32 ulps of O(1) results) bounds what conditioning allows and still fails
any real error. Singular vectors and eigenvectors are compared up to sign by the parity check
(portable/testing/gauge.py; tests/test_linalg_gauge.py); the cases here take the gauge-free
results (S, eigenvalues, and U/Vh-free calls)."""

from __future__ import annotations

import torch
from xla_cases import F32, A, C, t

# conditioning-bounded float32 error of a factorization (module docstring)
_FACTOR_TOL = (1e-5, 1e-5)


def square(dtype, *shape):
    """A well-conditioned square matrix (random plus n * I: eigenvalues away from 0)."""
    n = shape[-1]
    return (torch.randn(shape) + n * torch.eye(n)).to(dtype)


def spd(dtype, *shape):
    """A symmetric positive definite matrix, eigenvalues in [1, ~3]."""
    x = torch.randn(shape) / shape[-1] ** 0.5
    return (x @ x.mT + torch.eye(shape[-1])).to(dtype)


def sym(dtype, *shape):
    """A symmetric matrix with well separated eigenvalues of both signs."""
    x = torch.randn(shape)
    return (x + x.mT).to(dtype)


def lower(dtype, *shape):
    """A well-conditioned lower-triangular matrix."""
    return torch.tril(square(dtype, *shape))


def lu_of(dtype, *shape):
    """(LU, pivots) of a well-conditioned square matrix, as torch's getrf gives them."""
    return torch.linalg.lu_factor(square(dtype, *shape))


def qr_of(dtype, *shape):
    """(reflectors, tau) of a matrix, as torch's geqrf gives them."""
    return torch.geqrf(t(dtype, *shape))


def chol_of(dtype, *shape, upper=False):
    return torch.linalg.cholesky(spd(dtype, *shape), upper=upper)


_T = dict(tol=_FACTOR_TOL)
_LINALG = [
    C("aten.linalg_lu_factor_ex.default", lambda d: A(square(d, 4, 4)), **_T),
    C("aten.linalg_lu_factor_ex.default", lambda d: A(t(d, 2, 5, 5)), (F32,), "batch", **_T),
    C("aten.linalg_lu_factor_ex.default", lambda d: A(t(d, 3, 5)), (F32,), "wide", **_T),
    C("aten.linalg_lu_factor_ex.default", lambda d: A(t(d, 5, 3)), (F32,), "tall", **_T),
    C(
        "aten.linalg_lu_factor_ex.default",
        lambda d: A(torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]], dtype=d)),
        (F32,),
        "singular",
    ),
    C("aten.linalg_lu.default", lambda d: A(t(d, 2, 4, 4)), (F32,), **_T),
    C("aten.linalg_lu.default", lambda d: A(t(d, 3, 5)), (F32,), "wide", **_T),
    C("aten.lu_unpack.default", lambda d: A(*lu_of(d, 2, 4, 4)), (F32,), **_T),
    C("aten.lu_unpack.default", lambda d: A(*lu_of(d, 4, 4), False, True), (F32,), "pivots"),
    C("aten.linalg_lu_solve.default", lambda d: A(*lu_of(d, 4, 4), t(d, 4, 2)), (F32,), **_T),
    C(
        "aten.linalg_lu_solve.default",
        lambda d: A(*lu_of(d, 2, 4, 4), t(d, 2, 4, 3), adjoint=True),
        (F32,),
        "adjoint",
        **_T,
    ),
    C(
        "aten.linalg_lu_solve.default",
        lambda d: A(*lu_of(d, 4, 4), t(d, 3, 4), left=False),
        (F32,),
        "right",
        **_T,
    ),
    C("aten._linalg_solve_ex.default", lambda d: A(square(d, 4, 4), t(d, 4, 2)), (F32,), **_T),
    C(
        "aten._linalg_solve_ex.default",
        lambda d: A(square(d, 2, 4, 4), t(d, 2, 4)),
        (F32,),
        "vector",
        **_T,
    ),
    C(
        "aten._linalg_solve_ex.default",
        lambda d: A(square(d, 4, 4), t(d, 3, 4), left=False),
        (F32,),
        "right",
        **_T,
    ),
    C(
        "aten._linalg_solve_ex.default",
        lambda d: A(square(d, 3, 1, 4, 4), t(d, 2, 4, 1)),
        (F32,),
        "broadcast",
        **_T,
    ),
    C("aten.linalg_inv_ex.default", lambda d: A(square(d, 2, 4, 4)), (F32,), **_T),
    C("aten._linalg_det.default", lambda d: A(square(d, 2, 4, 4)), (F32,), **_T),
    C("aten._linalg_det.default", lambda d: A(t(d, 3, 3) * 0), (F32,), "zero"),
    C("aten._linalg_slogdet.default", lambda d: A(t(d, 2, 4, 4)), (F32,), **_T),
    C("aten.linalg_cholesky_ex.default", lambda d: A(spd(d, 2, 4, 4)), (F32,), **_T),
    C("aten.linalg_cholesky_ex.default", lambda d: A(spd(d, 4, 4), upper=True), (F32,), "up", **_T),
    C("aten.cholesky.default", lambda d: A(spd(d, 2, 4, 4)), (F32,), **_T),
    C("aten.cholesky.default", lambda d: A(spd(d, 4, 4), True), (F32,), "upper", **_T),
    C("aten.cholesky_solve.default", lambda d: A(t(d, 4, 2), chol_of(d, 4, 4)), (F32,), **_T),
    C(
        "aten.cholesky_solve.default",
        lambda d: A(t(d, 2, 4, 2), chol_of(d, 4, 4, upper=True), True),
        (F32,),
        "upper",
        **_T,
    ),
    C("aten.cholesky_inverse.default", lambda d: A(chol_of(d, 4, 4)), (F32,), **_T),
    C(
        "aten.cholesky_inverse.default",
        lambda d: A(chol_of(d, 4, 4, upper=True), True),
        (F32,),
        "upper",
        **_T,
    ),
    C(
        "aten.linalg_solve_triangular.default",
        lambda d: A(lower(d, 4, 4), t(d, 2, 4, 3), upper=False),
        (F32,),
        **_T,
    ),
    C(
        "aten.linalg_solve_triangular.default",
        lambda d: A(lower(d, 4, 4).mT, t(d, 3, 4), upper=True, left=False, unitriangular=True),
        (F32,),
        "right-unit",
        **_T,
    ),
    C("aten.triangular_solve.default", lambda d: A(t(d, 4, 2), lower(d, 4, 4).mT), (F32,), **_T),
    C(
        "aten.triangular_solve.default",
        lambda d: A(t(d, 2, 4, 2), lower(d, 4, 4), False, True),
        (F32,),
        "transpose",
        **_T,
    ),
    C("aten.linalg_qr.default", lambda d: A(t(d, 2, 5, 3)), (F32,), **_T),
    C("aten.linalg_qr.default", lambda d: A(t(d, 3, 5), "complete"), (F32,), "wide", **_T),
    C("aten.linalg_qr.default", lambda d: A(t(d, 5, 3), "complete"), (F32,), "complete", **_T),
    C("aten.linalg_qr.default", lambda d: A(t(d, 4, 3), "r"), (F32,), "r", **_T),
    # singular values alone (U and Vh are compared up to sign in tests/test_linalg_gauge.py)
    C("aten._linalg_svd.default", lambda d: A(t(d, 2, 5, 3), False, False), (F32,), **_T),
    C("aten._linalg_eigh.default", lambda d: A(sym(d, 2, 4, 4), "L", False), (F32,), **_T),
    C("aten._linalg_eigh.default", lambda d: A(sym(d, 4, 4), "U", False), (F32,), "upper", **_T),
    C("aten.geqrf.default", lambda d: A(t(d, 2, 5, 3)), (F32,), **_T),
    C("aten.geqrf.default", lambda d: A(t(d, 3, 5)), (F32,), "wide", **_T),
    C("aten.linalg_householder_product.default", lambda d: A(*qr_of(d, 2, 5, 3)), (F32,), **_T),
    C("aten.ormqr.default", lambda d: A(*qr_of(d, 2, 5, 3), t(d, 2, 5, 4)), (F32,), **_T),
    C(
        "aten.ormqr.default",
        lambda d: A(*qr_of(d, 5, 3), t(d, 4, 5), False, True),
        (F32,),
        "right-transpose",
        **_T,
    ),
]
