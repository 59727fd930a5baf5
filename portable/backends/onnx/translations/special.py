"""ONNX rules for the opset family `special` (portable/opset/families/special.py); the ops it has no
rule for are refused by capability (backends/onnx/unsupported.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TRANSLATIONS"]

TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {}
