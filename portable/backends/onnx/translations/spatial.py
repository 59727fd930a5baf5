"""ONNX rules for the opset family `spatial` (portable/opset/families/spatial.py); the ops it has no
rule for are refused by capability (backends/onnx/unsupported.py).

- `grid_sampler_2d`: ONNX `GridSample` (torchlib's rule) for bilinear and nearest, every padding
  mode and align_corners, in float32 and float64. Refused: bicubic (ONNX Runtime's sums round
  apart from torch's FMA-contracted kernel by 1e-4 relative where taps cancel) and half types
  (torch computes them in the half type; the bfloat16 rewrite would compute in float32).
- `addmv`, `addbmm`: torchlib's products, but with beta = 0 `self` is ignored (torchlib multiplies
  it by 0, which keeps NaN and inf); refused for half types (torch rounds addbmm after each
  batch, and applies beta and alpha rounded to the half type; ONNX Runtime computes in float32).
- `adaptive_max_pool3d`: the window taps gathered and reduced, choosing the index torch's CPU
  kernel chooses (the last NaN, else the first maximum), shared with `adaptive_max_pool2d`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from onnxscript.function_libs.torch_lib.ops import core as torchlib_core

from portable.backends import sampling

from .resize import _HALF, _const, _ints, _kind, _max_of_taps, _sizes, op

__all__ = ["TRANSLATIONS"]

_ATEN = torch.ops.aten
_BICUBIC = 2


def grid_sampler_2d(input: Any, grid: Any, interpolation_mode, padding_mode, align_corners):
    if int(interpolation_mode) == _BICUBIC:
        raise ValueError(
            "bicubic grid sampling does not round as torch's kernel does in ONNX Runtime; "
            "use mode='bilinear' or 'nearest', or run on `cpu`"
        )
    if _kind(input) in _HALF or _kind(grid) in _HALF:
        raise ValueError(
            f"torch samples {_kind(input).lower()} grids in that type, ONNX Runtime in float32; "
            "run on `cpu` or in float32"
        )
    return torchlib_core.aten_grid_sampler_2d(
        input, grid, int(interpolation_mode), int(padding_mode), bool(align_corners)
    )


def _not_half(name: str, *values: Any) -> None:
    for value in values:
        if _kind(value) in _HALF:
            raise ValueError(
                f"torch rounds {name} in {_kind(value).lower()} where ONNX Runtime computes "
                "float32; run on `cpu` or in float32"
            )


def _times(x: Any, factor: float) -> Any:
    return x if factor == 1 else op.Mul(x, op.CastLike(_const(np.array(factor)), x))


def addmv(self: Any, mat: Any, vec: Any, beta: float = 1.0, alpha: float = 1.0):
    # beta * self + alpha * (mat @ vec); with beta == 0 self is ignored (even NaN)
    _not_half("addmv", self, mat, vec)
    if beta == 0:
        return _times(op.MatMul(mat, vec), alpha)
    return torchlib_core.aten_addmv(self, mat, vec, beta, alpha)


def addbmm(self: Any, batch1: Any, batch2: Any, beta: float = 1.0, alpha: float = 1.0):
    # beta * self + alpha * sum over b of batch1[b] @ batch2[b]; beta == 0 ignores self
    _not_half("addbmm", self, batch1, batch2)
    if beta == 0:
        products = op.ReduceSum(op.MatMul(batch1, batch2), _ints([0]), keepdims=0)
        return _times(products, alpha)
    return torchlib_core.aten_addbmm(self, batch1, batch2, beta, alpha)


def adaptive_max_pool3d(self, output_size):
    sizes = zip(_sizes(self, 3), output_size, strict=True)
    return _max_of_taps(self, [sampling.adaptive_axis(n, int(o)) for n, o in sizes])


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    _ATEN.grid_sampler_2d.default: grid_sampler_2d,
    _ATEN.adaptive_max_pool3d.default: adaptive_max_pool3d,
    _ATEN.addmv.default: addmv,
    _ATEN.addbmm.default: addbmm,
}
