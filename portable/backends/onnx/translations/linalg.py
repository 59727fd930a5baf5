"""ONNX rules for the opset family `linalg` (portable/opset/families/linalg.py); the ops it has no
rule for are refused by capability (backends/onnx/unsupported.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TRANSLATIONS"]

TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {}
