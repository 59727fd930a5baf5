"""Refuse, before export, tensors a program cannot hold: sparse layouts.

torch.export traces them without complaint (fake tensors carry no layout contract), and the
program then fails raw later: a sparse input runs through `addmm` on `cpu` and breaks parity and
other backends. So every parameter, buffer and example input is checked first, and the refusal
names the tensor and the fix. Meta tensors (no data) are not refused: they make an abstract
program (capture/abstract.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import CaptureError
from ..runtime import storage_problem

__all__ = ["check_tensors"]

_INPUT_FIX = "pass dense example inputs (sparse: x.to_dense())"
_STATE_FIX = "make it dense before capture (module.register_buffer(name, t.to_dense()))"


def check_tensors(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """CaptureError for the first parameter, buffer or example input that is not dense."""
    owner = type(model).__name__
    for name, param in model.named_parameters():
        _check_state(param, f"parameter `{name}` of {owner}")
    for name, buffer in model.named_buffers():
        _check_state(buffer, f"buffer `{name}` of {owner}")
    for where, leaf in _leaves(args, kwargs):
        problem = _layout_problem(leaf)
        if problem is not None:
            raise CaptureError(f"example input {where} {problem}", fix=_INPUT_FIX)


def _check_state(value: torch.Tensor, what: str) -> None:
    problem = _layout_problem(value)
    if problem is not None:
        raise CaptureError(f"{what} {problem}", fix=_STATE_FIX)


def _layout_problem(value: torch.Tensor) -> str | None:
    """`storage_problem` less "no data": a meta tensor captures abstractly."""
    return None if value.is_meta else storage_problem(value)


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for every tensor in the example inputs: `0`, `0['ids']`, `` `x` ``."""
    labelled = [(str(i), a) for i, a in enumerate(args)]
    labelled += [(f"`{key}`", a) for key, a in kwargs.items()]
    for label, arg in labelled:
        for path, leaf in pytree.tree_flatten_with_path(arg)[0]:
            if isinstance(leaf, torch.Tensor):
                yield label + pytree.keystr(path), leaf
