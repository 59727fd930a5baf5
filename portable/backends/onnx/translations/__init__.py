"""The `custom_translation_table` for `torch.onnx.export`: one ONNX rule per portable op.

nn.py covers attention, the norms, scale_mask_softmax and the collectives of one rank; mx.py the
MX quantize / dequantize ops; reductions.py the ATen reductions whose torchlib rules fail on
edge cases (all dims, 0-d inputs); dtypes.py those ONNX Runtime cannot run for a dtype the
opset declares (integer Gemm and Relu, bool Where); math.py, selection.py and resize.py the ATen ops of opset 1.3
whose torchlib rules are missing or wrong. Other ATen ops are translated by torch.onnx's own library.
Importing this package imports onnxscript: only the backend's methods do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .dtypes import TRANSLATIONS as DTYPE_TRANSLATIONS
from .linalg import TRANSLATIONS as LINALG_TRANSLATIONS
from .math import TRANSLATIONS as MATH_TRANSLATIONS
from .mx import TRANSLATIONS as MX_TRANSLATIONS
from .nn import TRANSLATIONS as NN_TRANSLATIONS
from .reductions import TRANSLATIONS as REDUCTION_TRANSLATIONS
from .resize import TRANSLATIONS as RESIZE_TRANSLATIONS
from .selection import TRANSLATIONS as SELECTION_TRANSLATIONS
from .spatial import TRANSLATIONS as SPATIAL_TRANSLATIONS
from .special import TRANSLATIONS as SPECIAL_TRANSLATIONS

__all__ = ["translation_table"]


def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """Every portable op's ONNX rule, by op overload (the exporter's table type)."""
    tables = (
        NN_TRANSLATIONS,
        MX_TRANSLATIONS,
        REDUCTION_TRANSLATIONS,
        MATH_TRANSLATIONS,
        SELECTION_TRANSLATIONS,
        RESIZE_TRANSLATIONS,
        SPECIAL_TRANSLATIONS,
        SPATIAL_TRANSLATIONS,
        LINALG_TRANSLATIONS,
        DTYPE_TRANSLATIONS,
    )
    return {op: rule for table in tables for op, rule in table.items()}
