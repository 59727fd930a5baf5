"""Refuse, before export, tensors a program cannot hold: sparse layouts and meta tensors.

torch.export traces both without complaint (fake tensors carry no layout or data contract), and
the program then fails raw later: a sparse input runs through `addmm` on `cpu` and breaks parity
and other backends; a meta model's weights have no data to snapshot or save. So every parameter,
buffer and example input is checked first, and the refusal names the tensor and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..errors import CaptureError
from ..runtime import storage_problem

__all__ = ["check_tensors"]

_INPUT_FIX = "pass dense example inputs with data (sparse: x.to_dense(); meta: real tensors)"
_STATE_FIX = {
    "sparse": "make it dense before capture (module.register_buffer(name, t.to_dense()))",
    "meta": "materialize the weights before capture: model.to_empty(device='cpu') and then "
    "model.load_state_dict(...) (capturing meta models is not supported yet)",
}


def check_tensors(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """CaptureError for the first parameter, buffer or example input that is not dense with data."""
    owner = type(model).__name__
    for name, param in model.named_parameters():
        _check_state(param, f"parameter `{name}` of {owner}")
    for name, buffer in model.named_buffers():
        _check_state(buffer, f"buffer `{name}` of {owner}")
    for where, leaf in _leaves(args, kwargs):
        problem = storage_problem(leaf)
        if problem is not None:
            raise CaptureError(f"example input {where} {problem}", fix=_INPUT_FIX)


def _check_state(value: torch.Tensor, what: str) -> None:
    problem = storage_problem(value)
    if problem is not None:
        raise CaptureError(
            f"{what} {problem}", fix=_STATE_FIX["meta" if value.is_meta else "sparse"]
        )


def _leaves(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for every tensor in the example inputs: `0`, `0['ids']`, `` `x` ``."""
    labelled = [(str(i), a) for i, a in enumerate(args)]
    labelled += [(f"`{key}`", a) for key, a in kwargs.items()]
    for label, arg in labelled:
        for path, leaf in pytree.tree_flatten_with_path(arg)[0]:
            if isinstance(leaf, torch.Tensor):
                yield label + pytree.keystr(path), leaf
