"""The portable opset: a declared, versioned set of core ATen ops plus `portable::` ops.

Importing this package registers the `portable::` ops with torch.library. The table of entries
(name, signature, dtypes, semantics, shape rule) is in `table.py`; `lookup` resolves a graph
node's target to its entry.
"""

from __future__ import annotations

from . import collectives, mx_ops, nn_ops  # noqa: F401  (registers portable:: ops)
from .bind import Bound, OperandError, bind
from .table import OPSET_VERSION, OpDef, lookup, op_name, opset_table, resolve

__all__ = [
    "OPSET_VERSION",
    "Bound",
    "OpDef",
    "OperandError",
    "bind",
    "lookup",
    "op_name",
    "opset_table",
    "resolve",
]
