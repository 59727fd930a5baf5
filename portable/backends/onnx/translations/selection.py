"""ONNX rules for the ATen ops of reductions, sorting, selection and scans added with opset 1.3 whose torch.onnx rules are missing or wrong (each entry
says why); the others are translated by torch.onnx's own library."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TRANSLATIONS"]

TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {}
