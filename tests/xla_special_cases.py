"""The `xla` rule table's cases for the opset family `special` (rules/special.py). Builders and
`Case` are in tests/xla_cases.py."""

from __future__ import annotations

_SPECIAL: list = []
