"""A run's JSON-lines records, read when present (a job that never evaluated has no eval.jsonl)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .metrics import read_jsonl

__all__ = ["read_records"]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of `path`, or none when the file does not exist."""
    return read_jsonl(path) if path.is_file() else []
