"""The decomposition table of capture: core ATen, minus what the opset keeps whole."""

from __future__ import annotations

import torch
from torch._decomp import core_aten_decompositions

from ..opset import op_name, opset_table


def decompositions(python_only: bool):
    """Core ATen decompositions, minus every op the opset keeps whole (silu, gelu_backward,
    the losses, ...): their decompositions round differently from the eager kernels, and a
    captured program must match eager PyTorch bit for bit on `cpu`. A plain dict for the
    joint-graph path, torch.export's table type otherwise."""
    table = core_aten_decompositions() if python_only else torch.export.default_decompositions()
    keep = set(opset_table())
    for op in list(table.keys()):
        if isinstance(op, torch._ops.OpOverload) and op_name(op) in keep:
            del table[op]
    return table
