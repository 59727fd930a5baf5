"""Resource limits for what portable allocates on behalf of a file from elsewhere.

An archive, a plan or a program declares shapes; portable never trusts them with memory. Before
it allocates a tensor whose size comes from a declared shape (example inputs for `--parity`, the
intermediates of a program about to run), the size is checked here, and reading JSON documents is
bounded in bytes and nesting depth.

    portable.limits.current().max_tensor_bytes        # 4 GiB by default
    with portable.limits.override(max_tensor_bytes=16 << 30):
        ...                                            # a larger model, this block only
    portable.limits.configure(max_tensor_bytes=16 << 30)   # for the rest of the process

The CLI sets the same value with `portable --max-alloc 16GiB ...`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .errors import PortableError, ResourceLimitError
from .ir.signature import TensorSpec
from .ir.source import source_of
from .ir.symbolic import SizeExprError, parse_size

if TYPE_CHECKING:
    from .ir.program import Program

__all__ = [
    "Limits",
    "check_program",
    "check_tensor_bytes",
    "configure",
    "current",
    "format_bytes",
    "override",
    "parse_bytes",
    "tensor_bytes",
]

_GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Limits:
    """`max_tensor_bytes`: the largest single tensor portable allocates from a declared shape.
    `max_json_bytes` / `max_json_depth`: the largest JSON document (program.json, plan.json)
    read, and its deepest nesting of arrays and objects."""

    max_tensor_bytes: int = 4 * _GIB
    max_json_bytes: int = 512 << 20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise PortableError(
                    f"limit {field.name} must be a positive int, got {value!r}",
                    fix="pass a number of bytes (or levels), e.g. max_tensor_bytes=16 << 30",
                )


_current = Limits()


def current() -> Limits:
    """The limits in force."""
    return _current


def configure(**changes: int) -> Limits:
    """Change the process-wide limits (e.g. `max_tensor_bytes=16 << 30`); returns the new ones."""
    global _current
    _current = dataclasses.replace(_current, **changes)
    return _current


@contextlib.contextmanager
def override(**changes: int) -> Iterator[Limits]:
    """The limits changed for the duration of a `with` block."""
    global _current
    saved = _current
    _current = dataclasses.replace(saved, **changes)
    try:
        yield _current
    finally:
        _current = saved


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of `shape` and `dtype` (exact, no overflow)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return math.prod(int(d) for d in shape) * itemsize


def check_tensor_bytes(shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
    """Raise ResourceLimitError before allocating a tensor larger than `max_tensor_bytes`."""
    if any(int(d) < 0 for d in shape):
        raise ResourceLimitError(
            f"{what} has a negative dim in shape {list(shape)}", fix=_FIX_SHAPE
        )
    size, limit = tensor_bytes(shape, dtype), current().max_tensor_bytes
    if size > limit:
        raise ResourceLimitError(
            f"{what} would allocate {format_bytes(size)} "
            f"({'x'.join(str(d) for d in shape)} {str(dtype).removeprefix('torch.')}), "
            f"over the limit of {format_bytes(limit)}",
            fix="if the size is what you meant, raise the limit (portable --max-alloc SIZE, or "
            "portable.limits.configure(max_tensor_bytes=...)); if the file came from elsewhere, "
            "it declares a shape it should not",
        )


_FIX_SHAPE = "the program or archive declares an impossible shape; re-capture it"

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")


def parse_bytes(text: str) -> int:
    """`"16GiB"`, `"500MB"`, `"1048576"` -> bytes (PortableError on anything else)."""
    match = _SIZE.fullmatch(text.strip())
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise PortableError(
            f"bad size {text!r}",
            fix="write a number of bytes with an optional unit: 1048576, 500MB, 16GiB",
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """1536 -> "1.5 KiB"."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def check_program(program: Program, bindings: Mapping[str, int] | None = None) -> None:
    """Raise ResourceLimitError if running `program` would allocate a tensor over
    `max_tensor_bytes`: every node's recorded result, with dynamic dims from `bindings`."""
    for node in program.graph.nodes:
        meta = node.meta.get("tensor")
        for spec in meta if isinstance(meta, tuple) else (meta,):
            if not isinstance(spec, TensorSpec):
                continue
            try:
                shape = [
                    d if isinstance(d, int) else parse_size(d).evaluate(bindings or {})
                    for d in spec.shape
                ]
            except SizeExprError:
                continue  # unbound: checked when the call binds it
            src = source_of(node)
            where = f" (module {src.module})" if src and src.module else ""
            check_tensor_bytes(shape, spec.dtype, f"node {node.name} of {program.name}{where}")
