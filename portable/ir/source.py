"""Where a graph node came from: the user's module path and `file:line`.

Stored on each node as `node.meta["source"]` and carried through passes and the archive, so every
error and report can point at the user's code (JAX's `source_info`, torch.fx's `stack_trace`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import torch.fx

__all__ = ["SourceLoc", "source_of"]

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n(?:\s+(.*))?')


@dataclasses.dataclass(frozen=True)
class SourceLoc:
    module: str | None = None  # module path, e.g. "blocks.0.attn"
    file: str | None = None
    line: int | None = None
    code: str | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.file else "<unknown>"
        return f"{where} ({self.module})" if self.module else where

    def location(self) -> str | None:
        if not self.file:
            return None
        return f"{self.file}:{self.line}" + (f"  `{self.code}`" if self.code else "")

    def stack_trace(self) -> str | None:
        """The location as a one-frame Python traceback (the form torch.fx's and torch.onnx's
        `stack_trace` metadata take), or None when the file is unknown."""
        if not self.file:
            return None
        frame = f'File "{self.file}", line {self.line}, in {self.module or "<model>"}'
        return frame + (f"\n    {self.code}" if self.code else "")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @staticmethod
    def from_json(data: dict[str, Any] | None) -> SourceLoc | None:
        return SourceLoc(**data) if data else None


def from_fx_meta(
    meta: dict[str, Any], is_user_file: Callable[[str], bool], strip_prefix: str = ""
) -> SourceLoc | None:
    """Build a SourceLoc from torch.export's `stack_trace` and `nn_module_stack` metadata;
    `is_user_file(path)` picks the frames of the user's code."""
    file = line = code = None
    frames = _FRAME.findall(meta.get("stack_trace") or "")
    user = [f for f in frames if is_user_file(f[0])]
    if user:
        file, lineno, _, text = user[-1]
        line, code = int(lineno), (text.strip() or None)
    module = None
    stack = meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        module = _clean_module_path(path, strip_prefix)
    if file is None and module is None:
        return None
    return SourceLoc(module=module, file=file, line=line, code=code)


def _clean_module_path(path: str, strip_prefix: str) -> str:
    if strip_prefix and path.startswith(strip_prefix):
        path = path[len(strip_prefix) :]
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = path.lstrip(".")
    return path or "<root>"


def source_of(node: torch.fx.Node) -> SourceLoc | None:
    src = node.meta.get("source")
    return src if isinstance(src, SourceLoc) else None
