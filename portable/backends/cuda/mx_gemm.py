"""The native MX GEMM: cuBLAS's block-scaled matmul over FP8 codes (what `mx_matmul` runs on
archs with native MX; `targets.CudaArch.native_mx` says which).

Operands are [rows, K] codes quantized along K with block 32, E8M0 scales; cuBLAS takes the
elements as float8 and the scales in the 128x4 swizzled layout.
"""

from __future__ import annotations

import torch

from portable.mx import swizzle_scales

__all__ = ["NATIVE_FORMATS", "scaled_mm_mx"]

# MX element format -> the float8 dtype the block-scaled GEMM reads its codes as
NATIVE_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def scaled_mm_mx(a_codes, a_scales, b_codes, b_scales, fmt, dtype, bias=None):
    """cuBLAS block-scaled GEMM: FP8 codes reinterpreted as float8, E8M0 scales swizzled."""
    element = NATIVE_FORMATS[fmt]
    a = a_codes.contiguous().view(element)
    b = b_codes.contiguous().view(element).t()  # [K, N] column-major: _scaled_mm's rhs layout
    sa = swizzle_scales(a_scales.contiguous()).view(torch.float8_e8m0fnu)
    sb = swizzle_scales(b_scales.contiguous()).view(torch.float8_e8m0fnu)
    out = torch._scaled_mm(a, b, sa, sb, out_dtype=dtype)
    return out if bias is None else out + bias
