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


def _batch_norm_with_update(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    momentum: float,
    eps: float,
) -> tuple[torch.Tensor, ...]:
    # _batch_norm_with_update_functional (what `F.batch_norm(training=True)` on running stats
    # it is passed functionalizes to) is the legit kernel in training mode, the same CPU kernel
    # (bit-identical), plus cuDNN's reserve space, which is empty on CPU
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps
    )
    reserve = aten.empty.memory_format([0], dtype=torch.uint8, device=x.device)
    return out, mean, rstd, reserve, new_mean, new_var


# ops core ATen keeps whole that the opset spells with other ops
_EXTRA = {
    aten.copy.default: _copy,
    aten._batch_norm_with_update_functional.default: _batch_norm_with_update,
}


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
