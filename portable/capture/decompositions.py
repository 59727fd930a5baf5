"""The decomposition table of capture: core ATen, minus what the opset keeps whole, plus the
decompositions of ops real models use that core ATen keeps (`aten.copy`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import core_aten_decompositions

from ..opset import op_name, opset_table

aten = torch.ops.aten


def _copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    # copy(self, src) -> clone(expand(src.to(self.dtype), self.shape))
    # The functional form of `self.copy_(src)` (e.g. DeepSeek-V3 writing k_nope and k_rot into
    # slices of one key tensor): src broadcast to self's shape, in self's dtype, in new memory.
    # `_to_copy` rounds as `copy_` does (to nearest even), so the result is bit-identical.
    value = src if src.dtype == self.dtype else aten._to_copy.default(src, dtype=self.dtype)
    return aten.clone.default(aten.expand.default(value, list(self.shape)))


# ops core ATen keeps whole that the opset spells with other ops
_EXTRA = {aten.copy.default: _copy}


def decompositions(python_only: bool) -> dict[torch._ops.OperatorBase, Callable[..., Any]]:
    """Core ATen decompositions, minus every op the opset keeps whole (silu, gelu_backward,
    the losses, ...): their decompositions round differently from the eager kernels, and a
    captured program must match eager PyTorch bit for bit on `cpu`. Plus `_EXTRA`. A plain dict
    for the joint-graph path, torch.export's table type otherwise."""
    table = core_aten_decompositions() if python_only else torch.export.default_decompositions()
    keep = set(opset_table())
    for op in list(table.keys()):
        if isinstance(op, torch._ops.OpOverload) and op_name(op) in keep:
            del table[op]
    table.update(_EXTRA)
    return table
