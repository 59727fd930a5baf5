"""The grammars every string read from a file from elsewhere must match, as whole strings.

torch.fx turns a graph into Python source and `exec`s it: node names become variables and
parameters, kwargs keys become keyword arguments. So a name from an archive is accepted only if it
is exactly a plain identifier (`re.fullmatch`, never `match` / `^...$`, which lets a trailing
newline through), not a keyword and not a name the generated code itself needs. Other strings
(module paths, file names, weight keys, program names) never reach generated code, but they reach
error messages, manifests and file names, so they are printable text of bounded length with no
control characters, and program names hold no path separators.
"""

from __future__ import annotations

import builtins
import keyword
import re

__all__ = [
    "MAX_NAME",
    "MAX_TEXT",
    "bad_identifier",
    "bad_program_name",
    "bad_text",
    "is_identifier",
]

MAX_NAME = 255  # characters in a node, placeholder or symbol name
MAX_TEXT = 4096  # characters in any other string from a file

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TEXT = re.compile(r"[^\x00-\x1f\x7f-\x9f]*")
# what torch.fx's generated `forward` refers to besides node names: `self` is its first
# parameter; the rest are globals it binds (torch.fx.graph._custom_builtins)
_RESERVED = frozenset({"self", "torch", "inf", "nan", "NoneType", "device", "fx_pytree", "pytree"})
BUILTIN_NAMES = frozenset(dir(builtins))


def is_identifier(name: object) -> bool:
    """True for a plain ASCII identifier usable as a generated variable name."""
    return bad_identifier(name) is None


def bad_identifier(name: object) -> str | None:
    """Why `name` may not name a graph value (None when it may)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a string"
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long (at most {MAX_NAME})"
    if _IDENTIFIER.fullmatch(name) is None:
        return "is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*)"
    if keyword.iskeyword(name):
        return "is a Python keyword"
    if name in _RESERVED:
        return "is reserved by the generated code"
    return None


def bad_text(text: object, *, limit: int = MAX_TEXT) -> str | None:
    """Why `text` is not acceptable printable text (None when it is)."""
    if not isinstance(text, str):
        return f"is a {type(text).__name__}, not a string"
    if len(text) > limit:
        return f"is {len(text)} characters long (at most {limit})"
    if _TEXT.fullmatch(text) is None:
        return "contains control characters"
    return None


def bad_program_name(name: object) -> str | None:
    """Why `name` cannot name a program (None when it can): printable, at most 255 characters,
    no path separators, not `.` or `..`."""
    why = bad_text(name, limit=MAX_NAME)
    if why is not None:
        return why
    assert isinstance(name, str)
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        return "is empty, `.`, `..` or contains a path separator"
    return None
