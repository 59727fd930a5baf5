"""Opset families beyond the core table, one module each.

A family module declares `ENTRIES` (its `OpDef`s, in the order docs/opset.md lists them) and
`TRAITS` (trait name -> the names of its ops carrying that trait, for the traits `table.py`
assembles from families: ELEMENTWISE and REDUCTION). `table.opset_table()` joins them.
"""

from __future__ import annotations

from . import linalg, selection, spatial, special

FAMILIES = (special, selection, spatial, linalg)

__all__ = ["FAMILIES"]
