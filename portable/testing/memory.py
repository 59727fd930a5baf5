"""Memory of a program run as the `cpu` backend runs it, measured on real storages.

`measure_memory(program, flat_inputs)` executes the graph the `cpu` backend executes (the
program's graph, results in their traced layouts) node by node with torch.fx's `Interpreter`,
which drops each value after its last use as the generated code does. Every storage an op
returns that is not already live is counted, with a `weakref.finalize` on its `UntypedStorage`
subtracting it when torch frees it: what is measured is the storages really alive, views and
tuples included, not a model of them. Placeholders' storages (the caller's inputs) are never
counted. The static model of the same run is `portable.ir.liveness`; the two agree on the
examples (tests/test_remat.py).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from ..ir.program import Program
from ..opset.layouts import in_fake_layout
from ..torch_compat import copy_graph_module

__all__ = ["MeasuredMemory", "measure_memory"]


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    """`live_before[k]`: bytes of op-made storages alive just before node k of the program's
    graph runs; `live_during[k]`: alive right after it ran, before the values it read last are
    dropped (its peak); `peak_bytes` is the largest of those; `outputs` the graph's results."""

    live_before: tuple[int, ...]
    live_during: tuple[int, ...]
    outputs: tuple[Any, ...]

    @property
    def peak_bytes(self) -> int:
        return max(self.live_during, default=0)


class _Tracker:
    def __init__(self, inputs: Sequence[Any]) -> None:
        self.live = 0
        self._sizes: dict[int, int] = {}  # data_ptr -> bytes of a live storage we counted
        self._inputs = {s.data_ptr() for s in _storages(inputs)}

    def add(self, value: Any) -> None:
        for storage in _storages(value):
            ptr = storage.data_ptr()
            if ptr == 0 or ptr in self._inputs or ptr in self._sizes:
                continue
            self._sizes[ptr] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(storage, self._free, ptr)

    def _free(self, ptr: int) -> None:
        self.live -= self._sizes.pop(ptr)


def _storages(value: Any) -> Iterator[torch.UntypedStorage]:
    if isinstance(value, torch.Tensor):
        yield value.untyped_storage()
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _storages(v)


class _Measuring(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, tracker: _Tracker) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.tracker = tracker
        self.before: list[int] = []
        self.during: list[int] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        self.before.append(self.tracker.live)
        result = super().run_node(n)
        if n.op == "call_function":
            self.tracker.add(result)
        self.during.append(self.tracker.live)
        return result


def measure_memory(program: Program, flat_inputs: Sequence[torch.Tensor]) -> MeasuredMemory:
    """Run `program` once on `flat_inputs` (signature order) and measure (module docstring)."""
    gm = copy_graph_module(program.graph_module)
    in_fake_layout(gm)  # what the cpu backend runs
    tracker = _Tracker(flat_inputs)
    interpreter = _Measuring(gm, tracker)
    with torch.no_grad():
        outputs = interpreter.run(*flat_inputs)
    return MeasuredMemory(tuple(interpreter.before), tuple(interpreter.during), tuple(outputs))
