"""JSON documents from elsewhere (program.json, plan.json), read within bounds.

`json.loads` recurses once per nesting level, and so does everything that walks the result
(decoding, hashing), so a document of deeply nested lists raises RecursionError somewhere; and
a multi-GB file would be read whole. Here the size is checked before reading, the nesting depth
right after parsing (against `portable.limits`), NaN / Infinity literals are refused, and every
failure is the caller's typed error.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import PortableError
from .limits import current

__all__ = ["parse_json", "read_json"]


def read_json(path: Path, error: type[PortableError], *, fix: str) -> Any:
    """Parse the JSON file at `path` (a regular file, at most max_json_bytes, not a FIFO)."""
    limit = current().max_json_bytes
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise error(f"{path} is not a regular file", fix=fix)
            data = f.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}", fix=fix) from exc
    if len(data) > limit:
        raise error(f"{path} is over {limit} bytes", fix=fix)
    return parse_json(data, str(path), error, fix=fix)


def parse_json(data: bytes, where: str, error: type[PortableError], *, fix: str) -> Any:
    """Parse a JSON document from elsewhere: no NaN/Infinity literals, nesting at most
    `portable.limits` max_json_depth deep (so no later recursive walk can exhaust the stack),
    `error` on anything else wrong."""
    depth_limit = current().max_json_depth
    too_deep = error(
        f"{where} nests arrays/objects more than {depth_limit} deep",
        fix="a document this deep is not one portable wrote; re-save it",
    )
    try:
        doc = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:  # the C scanner recurses once per level
        raise too_deep from None
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise error(f"{where} is not valid JSON: {_cut(exc)}", fix=fix) from exc
    if _depth(doc, depth_limit) > depth_limit:
        raise too_deep
    return doc


def _depth(doc: Any, stop: int) -> int:
    """The deepest nesting of lists and dicts in `doc`, walked without recursion (stops
    counting past `stop`)."""
    deepest = 0
    stack = [(doc, 1)] if isinstance(doc, (dict, list)) else []
    while stack:
        value, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > stop:
                break
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _cut(value: object, limit: int = 200) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."
