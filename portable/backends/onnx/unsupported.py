"""The opset ops `onnx` does not export, and why: ONNX has no operator for them, or ONNX Runtime
none that computes what torch does. `OnnxBackend.capabilities()` leaves them out, so
`check_program` refuses them before lowering, naming the backends that take them. One dict per
opset family (portable/opset/families/)."""

from __future__ import annotations

__all__ = ["UNSUPPORTED"]

_NO_OP = "ONNX has no operator for it"
SPECIAL: dict[str, str] = {
    "aten.polygamma.default": _NO_OP,
    "aten.special_zeta.default": _NO_OP,
    "aten.special_zeta.self_scalar": _NO_OP,
    "aten.special_zeta.other_scalar": _NO_OP,
    "aten.i0.default": _NO_OP,
    "aten.special_i0e.default": _NO_OP,
    "aten.special_i1.default": _NO_OP,
    "aten.special_i1e.default": _NO_OP,
    "aten.special_ndtri.default": _NO_OP,
    "aten.special_erfcx.default": "torchlib's exp(x^2) * erfc(x) overflows and underflows (0 past 9, not torch's value)",
    "aten.igamma.default": _NO_OP,
    "aten.igammac.default": _NO_OP,
    "aten.nextafter.default": _NO_OP,
    "aten.fmax.default": _NO_OP,
    "aten.fmin.default": _NO_OP,
    "aten.frexp.Tensor": _NO_OP,
    "aten.signbit.default": "ONNX has no bit cast: a comparison misses the sign of -0.0 and -NaN",
    "aten.special_airy_ai.default": _NO_OP,
    "aten.special_bessel_j0.default": _NO_OP,
    "aten.special_bessel_j1.default": _NO_OP,
    "aten.special_bessel_y0.default": _NO_OP,
    "aten.special_bessel_y1.default": _NO_OP,
    "aten.special_modified_bessel_i0.default": _NO_OP,
    "aten.special_modified_bessel_i1.default": _NO_OP,
    "aten.special_modified_bessel_k0.default": _NO_OP,
    "aten.special_modified_bessel_k1.default": _NO_OP,
    "aten.special_scaled_modified_bessel_k0.default": _NO_OP,
    "aten.special_scaled_modified_bessel_k1.default": _NO_OP,
    "aten.special_spherical_bessel_j0.default": _NO_OP,
    "aten.special_chebyshev_polynomial_t.default": _NO_OP,
    "aten.special_chebyshev_polynomial_u.default": _NO_OP,
    "aten.special_chebyshev_polynomial_v.default": _NO_OP,
    "aten.special_chebyshev_polynomial_w.default": _NO_OP,
    "aten.special_shifted_chebyshev_polynomial_t.default": _NO_OP,
    "aten.special_shifted_chebyshev_polynomial_u.default": _NO_OP,
    "aten.special_shifted_chebyshev_polynomial_v.default": _NO_OP,
    "aten.special_shifted_chebyshev_polynomial_w.default": _NO_OP,
    "aten.special_hermite_polynomial_h.default": _NO_OP,
    "aten.special_hermite_polynomial_he.default": _NO_OP,
    "aten.special_laguerre_polynomial_l.default": _NO_OP,
    "aten.special_legendre_polynomial_p.default": _NO_OP,
}
_NO_SCAN = "ONNX has no running max/min with its index (CumSum only); torchlib none"
_NO_MEDIAN = "ONNX has no median operator (TopK's order among ties is not torch's); torchlib none"
_NO_SEARCH = "ONNX has no binary search over a sorted sequence; torchlib none"
SELECTION: dict[str, str] = {
    "aten.nonzero_static.default": "ONNX NonZero's result shape is data-dependent; no padding rule",
    "aten.cummax.default": _NO_SCAN,
    "aten.cummin.default": _NO_SCAN,
    "aten.logcumsumexp.default": "ONNX CumSum of exp overflows where torch's running log-add-exp does not",
    "aten.searchsorted.Tensor": _NO_SEARCH,
    "aten.bucketize.Tensor": _NO_SEARCH,
    "aten.mode.default": "ONNX has no mode (most frequent value) operator; torchlib none",
    "aten.kthvalue.default": "ONNX TopK's index among equal values is not torch's quickselect's",
    "aten.median.default": _NO_MEDIAN,
    "aten.nanmedian.default": _NO_MEDIAN,
    "aten.median.dim": _NO_MEDIAN,
    "aten.nanmedian.dim": _NO_MEDIAN,
}
SPATIAL: dict[str, str] = {
    "aten._upsample_bilinear2d_aa.default": "ONNX Resize has no antialias filter torch's matches",
    "aten._cdist_forward.default": "ONNX has no pairwise-distance operator; torchlib none",
    "aten._pdist_forward.default": "ONNX has no pairwise-distance operator; torchlib none",
    "aten._trilinear.default": "torchlib has no rule for _trilinear (F.bilinear)",
    "aten.grid_sampler_3d.default": "ONNX Runtime's GridSample takes 2-d inputs only",
}
_FACTOR = "ONNX has no factorization operators (LU, Cholesky, QR, SVD, eigen)"
_DET = "ONNX's Det gives the determinant alone, not the LU factors and pivots this op also returns"
_TRI = "ONNX has no triangular solve"
LINALG: dict[str, str] = {
    "aten.linalg_matrix_exp.default": "ONNX has no matrix exponential",
    "aten.linalg_ldl_factor_ex.default": _FACTOR,
    "aten.linalg_ldl_solve.default": _TRI,
    "aten.linalg_lu_factor_ex.default": _FACTOR,
    "aten.linalg_lu.default": _FACTOR,
    "aten.lu_unpack.default": "ONNX has no LU factorization, nor the pivot-to-permutation loop",
    "aten.linalg_lu_solve.default": _TRI,
    "aten._linalg_solve_ex.default": _FACTOR,
    "aten.linalg_inv_ex.default": _FACTOR + "; no matrix inverse either",
    "aten._linalg_det.default": _DET,
    "aten._linalg_slogdet.default": _DET,
    "aten.linalg_cholesky_ex.default": _FACTOR,
    "aten.cholesky.default": _FACTOR,
    "aten.cholesky_solve.default": _TRI,
    "aten.cholesky_inverse.default": _TRI,
    "aten.linalg_solve_triangular.default": _TRI,
    "aten.triangular_solve.default": _TRI,
    "aten.linalg_qr.default": _FACTOR,
    "aten._linalg_svd.default": _FACTOR,
    "aten._linalg_eigh.default": _FACTOR,
    "aten.geqrf.default": _FACTOR,
    "aten.linalg_householder_product.default": "ONNX has no Householder reflector product",
    "aten.ormqr.default": "ONNX has no Householder reflector product",
}

# core ops (portable/opset/table.py) without an ONNX rule
CORE: dict[str, str] = {
    "aten.bitwise_left_shift.Tensor": "ONNX BitShift takes unsigned integers only",
    "aten.bitwise_right_shift.Tensor": "ONNX BitShift takes unsigned integers only",
    "aten.gcd.default": _NO_OP,
    "aten.lcm.default": _NO_OP,
}
UNSUPPORTED: dict[str, str] = {**CORE, **SPECIAL, **SELECTION, **SPATIAL, **LINALG}
