"""The string form of passes and pipelines: `name` or `name{key=value,key2=value2}`.

    dce
    canonicalize{disable="clone,mul-by-one"}
    dce,canonicalize{disable=clone},dce            # a pipeline: top-level commas separate passes

Values are converted to the option's declared type: `true`/`false` for bool, Python int and float
literals, and strings. A value that contains `,`, `{`, `}`, `=`, `"` or spaces is written in double
quotes (`\\"` and `\\\\` escape inside them); `none` (unquoted) is None for a `T | None` option.
`format_pass` writes the canonical form (only options that differ from their defaults), so
`parse_pass(format_pass(p)) == p`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from portable.errors import PassError

from .base import Pass, format_pass, option_type, optional, type_name
from .registry import registry as default_registry

if TYPE_CHECKING:
    from portable.registry import Registry

__all__ = ["build_pass", "describe_options", "format_pass", "parse_pass", "parse_pipeline"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


@dataclasses.dataclass(frozen=True)
class _Raw:
    """One option as written: `quoted` tells `"none"` (a string) from `none` (None)."""

    text: str
    quoted: bool


def parse_pipeline(text: str, registry: Registry[type[Pass]] | None = None) -> list[Pass]:
    """`"dce,canonicalize{...}"` -> the passes, in order (an empty string is no passes)."""
    return [parse_pass(item, registry) for item in _split(text, ",", what=text) if item.strip()]


def parse_pass(text: str, registry: Registry[type[Pass]] | None = None) -> Pass:
    """One pass from its string form. RegistryError for an unknown name; PassError for bad
    syntax, an unknown option or a value that does not convert to the option's type."""
    text = text.strip()
    name, _, rest = text.partition("{")
    name = name.strip()
    if not _NAME.fullmatch(name) or (rest and not rest.endswith("}")):
        raise PassError(
            f"cannot parse pass {text!r}",
            pass_name=name or text,
            fix='write `name` or `name{key=value,key2="a value, with commas"}`',
        )
    cls = _registry(registry).get(name)
    raw: dict[str, _Raw] = {}
    for item in _split(rest[:-1], ",", what=text) if rest else []:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PassError(
                f"option {item.strip()!r} of pass {name!r} has no `=value`",
                pass_name=name,
                fix=f"options: {describe_options(cls)}",
            )
        if key in raw:
            raise PassError(f"option {key!r} of pass {name!r} is given twice", pass_name=name)
        raw[key] = _unquote(value.strip(), name)
    hints = typing.get_type_hints(cls)
    _check_names(cls, raw)
    return build_pass(
        cls, {key: _convert(cls, key, hints[key], value) for key, value in raw.items()}
    )


def build_pass(cls: type[Pass], options: Mapping[str, Any]) -> Pass:
    """`cls(**options)`, with a PassError naming the valid options for an unknown one."""
    _check_names(cls, options)
    return cls(**options)


def describe_options(cls: type[Pass]) -> str:
    """`disable: str = ''` for each option, or `none`."""
    hints = typing.get_type_hints(cls)
    parts = []
    for field in dataclasses.fields(cls):
        default = "" if field.default is dataclasses.MISSING else f" = {field.default!r}"
        parts.append(f"{field.name}: {type_name(hints[field.name])}{default}")
    return ", ".join(parts) or "none (this pass takes no options)"


def _registry(registry: Registry[type[Pass]] | None) -> Registry[type[Pass]]:
    return default_registry if registry is None else registry


def _check_names(cls: type[Pass], options: Mapping[str, Any]) -> None:
    valid = {f.name for f in dataclasses.fields(cls)}
    for key in options:
        if key not in valid:
            raise PassError(
                f"pass {cls.name!r} has no option {key!r}",
                pass_name=cls.name,
                fix=f"options: {describe_options(cls)}",
            )


def _convert(cls: type[Pass], key: str, hint: Any, raw: _Raw) -> Any:
    kind = option_type(hint)
    text = raw.text
    if not raw.quoted and text == "none" and optional(hint):
        return None
    try:
        if raw.quoted and kind is not str:
            raise ValueError
        if kind is bool:
            return {"true": True, "false": False}[text]
        if kind is int:
            if _looks_float(text):
                raise ValueError(text)
            return int(text, 0)
        if kind is float:
            return float(text)
        return text
    except (KeyError, ValueError):
        expected = "true or false" if kind is bool else type_name(hint)
        shown = f'"{text}"' if raw.quoted else repr(text)
        raise PassError(
            f"option {key!r} of pass {cls.name!r} must be {expected}, got {shown}",
            pass_name=cls.name,
            fix=f"options: {describe_options(cls)}",
        ) from None


def _looks_float(text: str) -> bool:
    return not text.lower().startswith(("0x", "-0x", "+0x")) and any(c in text for c in ".eE")


def _unquote(text: str, name: str) -> _Raw:
    if not text.startswith('"'):
        if '"' in text:
            raise PassError(
                f"stray quote in option value {text!r} of pass {name!r}",
                pass_name=name,
                fix='quote the whole value: key="..."',
            )
        return _Raw(text, quoted=False)
    out, i = [], 1
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            out.append(text[i + 1])
            i += 2
            continue
        if c == '"':
            if i != len(text) - 1:
                break
            return _Raw("".join(out), quoted=True)
        out.append(c)
        i += 1
    raise PassError(
        f"badly quoted option value {text!r} of pass {name!r}",
        pass_name=name,
        fix='write "..." around the whole value, with \\" for a quote inside it',
    )


def _split(text: str, sep: str, *, what: str) -> list[str]:
    """Split on `sep` outside braces and double quotes."""
    parts, depth, quoted, start, i = [], 0, False, 0, 0
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                break
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    if quoted or depth != 0:
        raise PassError(
            f"unbalanced braces or quotes in {what!r}",
            pass_name=what.split("{", 1)[0].strip() or what,
            fix='close every `{` and `"`',
        )
    parts.append(text[start:])
    return parts
