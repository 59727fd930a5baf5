"""The `xla` rule table's cases for the opset family `selection` (rules/selection.py). Builders and
`Case` are in tests/xla_cases.py."""

from __future__ import annotations

_SELECTION: list = []
