"""The portable opset: a declared, versioned set of core ATen ops plus `portable::` ops.

Importing this package registers the `portable::` ops with torch.library. The table of entries
(name, signature, dtypes, semantics, shape rule, traits) is in `table.py`; `lookup` resolves a
graph node's target to its entry, `ops_with(trait)` gives the targets of one op group, and
`bind(node)` (`bind.py`) reads a node's arguments by schema name.
"""

from __future__ import annotations

from . import collectives, mx_ops, nn_ops  # noqa: F401  (registers portable:: ops)
from .bind import Bound, OperandError, bind
from .table import (
    OPSET_VERSION,
    TRAITS,
    OpDef,
    has_trait,
    lookup,
    op_name,
    ops_with,
    opset_table,
    resolve,
)

__all__ = [
    "OPSET_VERSION",
    "TRAITS",
    "Bound",
    "OpDef",
    "OperandError",
    "bind",
    "has_trait",
    "lookup",
    "op_name",
    "ops_with",
    "opset_table",
    "resolve",
]
