"""Linear algebra: factorizations (Cholesky, LU, QR, SVD, symmetric eigen), solves, inverses and
determinants. Rules exist for `xla` only: Neuron's compiler and ONNX have no factorization ops;
the matrix exponential and LDL^T run on `cpu` and `cuda` alone.

Matrices are the last two dims, batch dims in front. The `*_ex` ops' `info` is LAPACK's int32
code (0: success); a compiled program does not raise where eager checks it. Singular vectors and
eigenvectors are defined up to the sign of each vector (each backend's LAPACK picks one)."""

from __future__ import annotations

from ..entry import FLOAT, OpDef, entry

ENTRIES: tuple[OpDef, ...] = (
    entry(
        "aten.linalg_lu_factor_ex.default",
        FLOAT,
        "tuple",
        "(packed LU, 1-based pivots, info) of A = P L U, partial pivoting",
    ),
    entry("aten.linalg_lu.default", FLOAT, "tuple", "(P, L, U) with A = P L U, partial pivoting"),
    entry("aten.lu_unpack.default", FLOAT, "tuple", "(P, L, U) from a packed LU and its pivots"),
    entry(
        "aten.linalg_lu_solve.default",
        FLOAT,
        "matmul",
        "X with A X = B (X A = B, A^H) from A's packed LU",
    ),
    entry(
        "aten._linalg_solve_ex.default",
        FLOAT,
        "tuple",
        "(X with A X = B or X A = B, LU, pivots, info)",
    ),
    entry("aten.linalg_inv_ex.default", FLOAT, "tuple", "(A^-1, info) by LU"),
    entry("aten._linalg_det.default", FLOAT, "tuple", "(det A, LU, pivots)"),
    entry("aten._linalg_slogdet.default", FLOAT, "tuple", "(sign det A, log |det A|, LU, pivots)"),
    entry(
        "aten.linalg_cholesky_ex.default",
        FLOAT,
        "tuple",
        "(L with A = L L^T, or U = L^T, info) from one triangle",
    ),
    entry("aten.cholesky.default", FLOAT, "same", "L with A = L L^T (U = L^T when upper)"),
    entry(
        "aten.cholesky_solve.default",
        FLOAT,
        "matmul",
        "X with L L^T X = B from the Cholesky factor",
    ),
    entry("aten.cholesky_inverse.default", FLOAT, "same", "(L L^T)^-1 from the Cholesky factor"),
    entry(
        "aten.linalg_solve_triangular.default",
        FLOAT,
        "matmul",
        "X with T X = B (X T = B) for triangular T",
    ),
    entry("aten.triangular_solve.default", FLOAT, "tuple", "(X with T X = B or T^T X = B, T)"),
    entry(
        "aten.linalg_qr.default",
        FLOAT,
        "tuple",
        "(Q, R) with A = Q R, R's diagonal by LAPACK's Householder convention",
    ),
    entry(
        "aten._linalg_svd.default", FLOAT, "tuple", "(U, S, Vh) with A = U diag(S) Vh, S descending"
    ),
    entry(
        "aten._linalg_eigh.default",
        FLOAT,
        "tuple",
        "(ascending eigenvalues, eigenvectors) of a symmetric A from one triangle",
    ),
    entry(
        "aten.geqrf.default",
        FLOAT,
        "tuple",
        "(Householder reflectors below R, their scalars tau): LAPACK geqrf",
    ),
    entry(
        "aten.linalg_householder_product.default",
        FLOAT,
        "same",
        "the first n columns of the product of the Householder reflectors (orgqr)",
    ),
    entry(
        "aten.ormqr.default",
        FLOAT,
        "matmul",
        "Q C, Q^T C, C Q or C Q^T with Q from Householder reflectors",
    ),
    # torch's kernels alone (cpu, cuda): no compiled backend reproduces them to tolerance
    # (tests/test_xla_rules.py EXCLUDED says why); xla, neuron and onnx refuse by capability
    entry(
        "aten.linalg_matrix_exp.default",
        FLOAT,
        "same",
        "e^A: torch's Taylor polynomial of a degree chosen by the norm, scaling and squaring",
    ),
    entry(
        "aten.linalg_ldl_factor_ex.default",
        FLOAT,
        "tuple",
        "(compact LD, pivots, info) of A = L D L^T with Bunch-Kaufman pivoting (LAPACK sytrf)",
    ),
    entry(
        "aten.linalg_ldl_solve.default",
        FLOAT,
        "matmul",
        "X with A X = B from A's compact LD and pivots (LAPACK sytrs)",
    ),
)
TRAITS: dict[str, tuple[str, ...]] = {}
