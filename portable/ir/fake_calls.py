"""Fake-kernel calls memoized by their inputs' layouts.

Re-deriving every node's shape and dtype (the verifier, spmd-partition) runs each op's fake
kernel once per node; a model of 80 identical layers repeats the same few hundred calls 80 times,
and one fake call costs torch tens of microseconds. `FakeCalls` returns the result of an earlier
call with the same op, the same tensor layouts (shape, dtype, strides, offset) and the same
literals. A fake kernel sees nothing else of its inputs, so the result is the one the call would
give; results are shared between the nodes that made the same call (fake values are read, never
written). Calls with symbolic sizes are not memoized.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FakeCalls", "call_key"]


class FakeCalls:
    """`calls(target, args, kwargs)`: `target(*args, **kwargs)` under `mode`, memoized."""

    def __init__(self, mode: FakeTensorMode) -> None:
        self.mode = mode
        self._done: dict[tuple, Any] = {}

    def __call__(self, target: Any, args: Any, kwargs: Any) -> Any:
        key = call_key(target, (args, kwargs))
        if key is not None and key in self._done:
            return self._done[key]
        with self.mode:
            result = target(*args, **kwargs)
        if key is not None:
            self._done[key] = result
        return result


def call_key(target: Any, value: Any) -> tuple | None:
    """What a fake kernel's result depends on: the op, and per argument its layout (tensors) or
    its value (literals); None where a symbolic size appears."""
    parts: list[Any] = [target]

    def visit(v: Any) -> bool:
        if isinstance(v, torch.Tensor):
            shape = tuple(v.shape)
            if not all(isinstance(d, int) for d in shape):
                return False
            parts.append((shape, v.dtype, v.stride(), v.storage_offset()))
        elif isinstance(v, (list, tuple)):
            parts.append((type(v), len(v)))
            return all(visit(x) for x in v)
        elif isinstance(v, dict):
            parts.append(tuple(v))
            return all(visit(x) for x in v.values())
        elif isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return False
        else:
            parts.append((type(v), repr(v)))
        return True

    return tuple(parts) if visit(value) else None
