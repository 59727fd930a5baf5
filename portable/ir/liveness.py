"""Buffers of a graph run in program order, and how long each one lives.

This is the memory model of the `cpu` backend, which runs a program's graph with eager PyTorch
in node order: torch.fx's generated code drops each value after its last use, so a buffer is
allocated by the op that makes it and freed after the last node that reads it through any alias.

- A **buffer** is one tensor result of an op that allocates: a single-result op's result, or each
  element of a multi-result op's tuple (`native_layer_norm`'s three, allocated together).
- **Aliases** allocate nothing: view ops (the opset's `view` trait: `view`, `transpose`,
  `expand`, `slice`, ..., and `_unsafe_view`) and ops whose schema makes their results views
  of their first argument (`OpOverload.is_view`: `split_with_sizes`, `diagonal`) read its
  buffers; `getitem` of a tuple reads the
  element it picks; a tuple node reads all of its elements (the tuple keeps them alive until its
  last `getitem`).
- Placeholders (the signature's inputs) are the caller's and never counted; values the graph
  returns live to the end.

Sizes come from each node's `meta["tensor"]` (`numel * itemsize`); a dynamic dim is evaluated
with `bindings`, and a buffer whose size is unbound counts 0 bytes (`Liveness.unsized` says how
many). Workspace an op allocates and frees inside its kernel is not modelled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence

import torch
import torch.fx

from ..opset import ops_with
from ..opset.table import VIEW
from .signature import TensorSpec
from .symbolic import SizeExprError, parse_size

__all__ = ["Buffer", "Liveness", "aliased_inputs", "liveness", "spec_nbytes"]


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One allocation: `owner`'s result (element `index` of a tuple, else None), allocated at
    position `start` and freed after position `end` (positions index `Liveness.nodes`; the end
    is `len(nodes)` for a value the graph returns). `readers` are the nodes that read it through
    any alias, in graph order."""

    owner: torch.fx.Node
    index: int | None
    nbytes: int
    start: int
    end: int
    readers: tuple[torch.fx.Node, ...]


@dataclasses.dataclass(frozen=True)
class Liveness:
    """The buffers of one graph (see the module docstring). `peak_bytes` is the most bytes live
    while one node runs (its new buffers allocated, the buffers it reads last not yet freed),
    at `nodes[peak_position]`."""

    nodes: tuple[torch.fx.Node, ...]
    buffers: tuple[Buffer, ...]
    unsized: int

    @functools.cached_property
    def _profile(self) -> tuple[int, ...]:
        delta = [0] * (len(self.nodes) + 2)
        for b in self.buffers:
            delta[b.start] += b.nbytes
            delta[b.end + 1] -= b.nbytes
        live, out = 0, []
        for d in delta[: len(self.nodes)]:
            live += d
            out.append(live)
        return tuple(out)

    def live_during(self, position: int) -> int:
        """Bytes live while `nodes[position]` runs."""
        return self._profile[position]

    def live_before(self, position: int) -> int:
        """Bytes live between `nodes[position - 1]` and `nodes[position]`: made before it, read
        by it or later."""
        return sum(b.nbytes for b in self.buffers if b.start < position <= b.end)

    @property
    def peak_bytes(self) -> int:
        return max(self._profile, default=0)

    @property
    def peak_position(self) -> int:
        return self._profile.index(self.peak_bytes) if self._profile else 0


def spec_nbytes(spec: TensorSpec, bindings: Mapping[str, int] | None = None) -> int | None:
    """`numel * itemsize` of `spec`, dynamic dims from `bindings`; None when one is unbound."""
    dims = []
    for d in spec.shape:
        if isinstance(d, int):
            dims.append(d)
            continue
        try:
            dims.append(int(parse_size(d).evaluate(bindings or {})))
        except SizeExprError:
            return None
    return math.prod(dims) * spec.dtype.itemsize


def aliased_inputs(node: torch.fx.Node) -> tuple[torch.fx.Node, ...] | None:
    """The input nodes whose buffers `node`'s result aliases, or None when `node` allocates its
    own (see the module docstring). `getitem` is handled by `liveness`, not here."""
    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return None
    if target in ops_with(VIEW) or getattr(target, "is_view", False):
        first = node.args[0] if node.args else next(iter(node.kwargs.values()), None)
        return (first,) if isinstance(first, torch.fx.Node) else ()
    return None


def liveness(graph: torch.fx.Graph, bindings: Mapping[str, int] | None = None) -> Liveness:
    """Every buffer of `graph` and its lifetime in node order (see the module docstring)."""
    nodes = tuple(graph.nodes)
    position = {n: k for k, n in enumerate(nodes)}
    # value node -> the buffers (owner, index) it reads; placeholders read none of ours
    reads: dict[torch.fx.Node, tuple[tuple[torch.fx.Node, int | None], ...]] = {}
    sizes: dict[tuple[torch.fx.Node, int | None], int] = {}
    unsized = 0
    for node in nodes:
        if node.op != "call_function":
            reads[node] = ()
            continue
        if node.target is operator.getitem:
            whole, index = node.args[0], node.args[1]
            parts = reads.get(whole, ()) if isinstance(whole, torch.fx.Node) else ()
            picked = tuple(p for p in parts if p[1] == index and p[0] is whole)
            reads[node] = picked or parts  # an aliasing tuple (split): its input's buffers
            continue
        aliased = aliased_inputs(node)
        if aliased is not None:
            reads[node] = tuple(dict.fromkeys(b for a in aliased for b in reads.get(a, ())))
            continue
        own = _own_buffers(node, bindings)
        unsized += sum(size is None for _, size in own)
        sizes.update({key: size or 0 for key, size in own})
        reads[node] = tuple(key for key, _ in own)
    readers: dict[tuple[torch.fx.Node, int | None], list[torch.fx.Node]] = {k: [] for k in sizes}
    for node in nodes:
        for value in node.all_input_nodes:
            for key in reads.get(value, ()):
                readers[key].append(node)
    out = []
    for key, nbytes in sizes.items():
        owner, index = key
        users = tuple(dict.fromkeys(readers[key]))
        end = max((position[u] for u in users), default=position[owner])
        if any(u.op == "output" for u in users):
            end = len(nodes)
        out.append(Buffer(owner, index, nbytes, position[owner], end, users))
    return Liveness(nodes, tuple(out), unsized)


def _own_buffers(
    node: torch.fx.Node, bindings: Mapping[str, int] | None
) -> list[tuple[tuple[torch.fx.Node, int | None], int | None]]:
    """The buffers `node` allocates: ((node, index), bytes or None when unsized)."""
    meta = node.meta.get("tensor")
    if isinstance(meta, TensorSpec):
        return [((node, None), spec_nbytes(meta, bindings))]
    if isinstance(meta, Sequence):
        return [
            ((node, i), spec_nbytes(spec, bindings))
            for i, spec in enumerate(meta)
            if isinstance(spec, TensorSpec)
        ]
    return []
