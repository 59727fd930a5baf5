"""The `custom_translation_table` for `torch.onnx.export`: one ONNX rule per portable op.

nn.py covers attention, the norms, scale_mask_softmax and the collectives of one rank; mx.py the
MX quantize / dequantize ops. ATen ops are translated by torch.onnx's own library. Importing this
package imports onnxscript: only the backend's methods do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .mx import TRANSLATIONS as MX_TRANSLATIONS
from .nn import TRANSLATIONS as NN_TRANSLATIONS

__all__ = ["translation_table"]


def translation_table() -> dict[Callable[..., Any], Callable[..., Any]]:
    """Every portable op's ONNX rule, by op overload (the exporter's table type)."""
    return {op: rule for table in (NN_TRANSLATIONS, MX_TRANSLATIONS) for op, rule in table.items()}
