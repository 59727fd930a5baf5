"""Abstract capture: a model whose weights have no data (built on the `meta` device).

A 70B-parameter model cannot be materialized on a build host, but its program (shapes, dtypes,
ops, the plan's per-rank shapes) needs no values. `torch.export` traces with fake tensors
anyway; what breaks on a meta model is the device: a meta weight meets a CPU tensor the model
makes while it runs (`torch.arange(n)` without a device, Hugging Face's rotary embedding) and the
trace fails with "Expected all tensors to be on the same device ... meta and cpu".

So, for the duration of a capture (`abstract_state`), every meta parameter and buffer of the
model is replaced by a data-less `FakeTensor` on the CPU (tied weights stay one tensor, a
`Parameter` stays a `Parameter` with its `requires_grad`), and meta example inputs likewise; the
model is restored afterwards. The program's weights are then meta tensors of the same shapes and
dtypes (`abstract_weight`): `Program.abstract` is true, passes that need no values run, and
whatever needs values refuses with `AbstractProgramError` (`Program.require_values`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..ir.program import has_no_data

__all__ = ["abstract_state", "abstract_weight", "fake_value", "is_abstract_model"]


def abstract_weight(value: torch.Tensor) -> torch.Tensor:
    """A program weight without data: a meta tensor of `value`'s shape and dtype (contiguous)."""
    return torch.empty(tuple(value.shape), dtype=value.dtype, device="meta")


def is_abstract_model(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> bool:
    """Whether any parameter, buffer or example input of a capture has no data."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for t in pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    return any(has_no_data(t) for t in tensors)


@contextlib.contextmanager
def abstract_state(
    model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any] | None]]:
    """Within: the model's meta parameters and buffers are data-less CPU fake tensors (module
    docstring); yields `(args, kwargs)` with meta example inputs replaced the same way. The
    model's own tensors are put back on exit, also when the capture fails."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, torch.Tensor] = {}

    def fake(value: torch.Tensor) -> torch.Tensor:
        if id(value) not in memo:
            with mode:
                empty = torch.empty(tuple(value.shape), dtype=value.dtype, device="cpu")
            if isinstance(value, torch.nn.Parameter):
                empty = torch.nn.Parameter(empty, requires_grad=value.requires_grad)
            memo[id(value)] = empty
        return memo[id(value)]

    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, value in list(table.items()):
                    if value is not None and value.is_meta:
                        swapped.append((table, name, value))
                        table[name] = fake(value)
        args, kwargs = pytree.tree_map_only(
            torch.Tensor, lambda t: fake(t) if t.is_meta else t, (args, kwargs)
        )
        yield args, kwargs
    finally:
        for table, name, value in reversed(swapped):
            table[name] = value


def fake_value(value: torch.Tensor, graph: torch.fx.Graph) -> torch.Tensor:
    """`value` as a node's `meta["val"]`: itself when it has data, else a data-less CPU fake
    of its shape and dtype in the fake mode of `graph`'s values (a new mode if it has none)."""
    if not has_no_data(value):
        return value
    mode = next(
        (n.meta["val"].fake_mode for n in graph.nodes if isinstance(n.meta.get("val"), FakeTensor)),
        None,
    )
    with mode or FakeTensorMode(allow_non_fake_inputs=True):
        return torch.empty(tuple(value.shape), dtype=value.dtype, device="cpu")
