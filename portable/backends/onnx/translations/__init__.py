"""The `custom_translation_table` for `torch.onnx.export`: one ONNX rule per portable op.

nn.py covers attention, the norms, scale_mask_softmax and the collectives of one rank; mx.py the
MX quantize / dequantize ops. ATen ops are translated by torch.onnx's own library. Importing this
package imports onnxscript: only the backend's methods do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .mx import TRANSLATIONS as MX_TRANSLATIONS
from .nn import TRANSLATIONS as NN_TRANSLATIONS

__all__ = ["translation_table"]


def translation_table() -> dict[torch._ops.OpOverload, Callable]:
    """Every portable op's ONNX rule."""
    return {**NN_TRANSLATIONS, **MX_TRANSLATIONS}
