"""ONNX rules for the ATen ops of elementwise math (rounding, inverse trigonometry, special functions, remainders) whose torch.onnx rules are missing or wrong (each entry
says why); the others are translated by torch.onnx's own library."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TRANSLATIONS"]

TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {}
