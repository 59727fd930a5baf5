"""The rule protocol: `Decision`, `RuleContext`, the `RULES` table, shared helpers, and the
rules of ops without tensor inputs (creation) and of tuple access (getitem)."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx

from portable.errors import PassError
from portable.ir.plan import Mesh
from portable.ir.sharding import Sharding
from portable.opset.bind import bind

from ..merges import Merge

__all__ = [
    "RULES",
    "Decision",
    "Key",
    "ResultSharding",
    "Rule",
    "RuleContext",
    "drop_partial",
    "merged_dims",
    "norm_dim",
    "out_ndim",
    "replicate_all",
    "replicated_like",
    "rule",
    "single",
    "tensor_args",
    "unshard_dims",
]

aten = torch.ops.aten

Key = str | tuple[str, int]
"""Where a rule's input sits in the call: an argument's schema name, or `(name, index)` for an
element of a list argument (cat's `tensors`, index's `indices`)."""

ResultSharding = Sharding | tuple[Sharding | None, ...] | None
"""A value's sharding: one `Sharding`, a tuple of them for a tuple-valued op (None for a
non-tensor element), None for a non-tensor result."""


@dataclasses.dataclass
class Decision:
    """A rule's answer: the sharding each tensor input must have, keyed by `Key`, and the result's.
    `args` replaces arguments by schema name (a reshape's sizes become the local sizes);
    `split_addmm` asks the walker to compute addmm as mm + add (its product is a partial sum);
    `vocab_parallel` names the axis of a vocabulary-parallel embedding (the walker's masked
    lookup on this rank's rows); `merged` gives dims of the result that merge dims whose split
    is not a contiguous chunk of the merged dim (`merges.py`: a reshape of context-parallel
    tokens [B, T/cp] -> [B*T/cp])."""

    inputs: dict[Key, Sharding]
    output: ResultSharding
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    split_addmm: bool = False
    vocab_parallel: str | None = None
    merged: dict[int, Merge] | None = None


class RuleContext:
    """What rules read about the values computed so far: their shardings, global shapes and
    dtypes (the walker's records), the mesh, which values are parameters, the plan's
    sequence-parallel and context axes, and the merged dims of values (`merges.py`)."""

    def __init__(
        self,
        mesh: Mesh,
        sharding: Mapping[torch.fx.Node, ResultSharding],
        shapes: Mapping[torch.fx.Node, tuple[int, ...]],
        dtypes: Mapping[torch.fx.Node, torch.dtype],
        sequence_parallel: str | None = None,
        parameters: frozenset[torch.fx.Node] = frozenset(),
        context_axis: str | None = None,
        merges: Mapping[torch.fx.Node, Mapping[int, Merge]] | None = None,
    ) -> None:
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self.context_axis = context_axis
        self._merges = merges if merges is not None else {}
        self._parameters = parameters
        self._sharding = sharding
        self._shapes = shapes
        self._dtypes = dtypes

    def sh(self, node: torch.fx.Node) -> Sharding:
        """The sharding of the tensor `node` (see `single`)."""
        return single(node, self._sharding[node])

    def sh_item(self, node: torch.fx.Node, index: int) -> Sharding | None:
        """The sharding of element `index` of the tuple-valued `node`."""
        value = self._sharding[node]
        if not isinstance(value, tuple):
            raise _not_one(node, value, "a tuple of shardings")
        return value[index]

    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        return self._shapes[node]

    def dtype(self, node: torch.fx.Node) -> torch.dtype:
        return self._dtypes[node]

    def numel(self, node: torch.fx.Node) -> int:
        return math.prod(self.shape(node))

    def merges(self, node: torch.fx.Node) -> Mapping[int, Merge]:
        """The merged dims of `node` whose rows are not a contiguous chunk (`merges.py`)."""
        return self._merges.get(node, {})

    def is_parameter(self, node: torch.fx.Node) -> bool:
        """Whether `node` is a parameter or a view/cast of one (no activation flows into it)."""
        return node in self._parameters


def single(node: torch.fx.Node, value: ResultSharding) -> Sharding:
    """`value`, the recorded sharding of `node`, as one tensor's; `PassError` when `node` is
    tuple-valued or not a tensor (a rule read it as a tensor: a bug in the rule)."""
    if not isinstance(value, Sharding):
        raise _not_one(node, value, "one tensor's sharding")
    return value


def _not_one(node: torch.fx.Node, value: ResultSharding, wanted: str) -> PassError:
    return PassError(
        f"{node.name} ({node.target}) has the sharding {value!r}, not {wanted}",
        pass_name="spmd-partition",
        fix="this is a bug in a sharding rule; report the program and plan",
    )


Rule = Callable[[RuleContext, torch.fx.Node], Decision]
"""A sharding rule: the `Decision` for one node (`replicate_all` where it cannot split it)."""

RULES: dict[Any, Rule] = {}


def rule(*targets: Any) -> Callable[[Rule], Rule]:
    """Register the decorated rule for every op of `targets`."""

    def register(fn: Rule) -> Rule:
        for t in targets:
            RULES[t] = fn
        return fn

    return register


# --------------------------------------------------------------------------- helpers


def tensor_args(node: torch.fx.Node) -> list[tuple[Key, torch.fx.Node]]:
    """`node`'s tensor inputs with their keys, in schema order: every argument that is a node,
    and every node in a list argument."""
    out: list[tuple[Key, torch.fx.Node]] = []
    for name, value in bind(node).items():
        if isinstance(value, torch.fx.Node):
            out.append((name, value))
        elif isinstance(value, (list, tuple)):
            out.extend(((name, j), x) for j, x in enumerate(value) if isinstance(x, torch.fx.Node))
    return out


def replicated_like(ctx: RuleContext, node: torch.fx.Node) -> Sharding:
    return Sharding.replicated(len(ctx.shape(node)))


def out_ndim(node: torch.fx.Node) -> int:
    return len(node.meta["tensor"].shape)


def replicate_all(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """The fallback: full copies in, full copy out."""
    inputs: dict[Key, Sharding] = {k: replicated_like(ctx, a) for k, a in tensor_args(node)}
    meta = node.meta["tensor"]
    out: ResultSharding
    if isinstance(meta, tuple):
        out = tuple(Sharding.replicated(len(m.shape)) if m is not None else None for m in meta)
    else:
        out = Sharding.replicated(len(meta.shape)) if meta is not None else None
    return Decision(inputs, out)


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def drop_partial(s: Sharding) -> Sharding:
    return Sharding(s.dims)


def merged_dims(
    shardings: Sequence[Sharding], whole: Sequence[int] = ()
) -> tuple[tuple[str, ...], ...]:
    """Per dim, the split of the first of `shardings` (all of one rank) that splits it, each axis
    used once; the dims in `whole` stay whole. Ops that take several same-shaped tensors (cat,
    slice_scatter) split where any input is split; replicated inputs are then sliced locally."""
    dims: list[tuple[str, ...]] = [() for _ in shardings[0].dims]
    used: set[str] = set()
    for s in shardings:
        for d, axes in enumerate(s.dims):
            if axes and not dims[d] and d not in whole and not used & set(axes):
                dims[d] = axes
                used |= set(axes)
    return tuple(dims)


def unshard_dims(s: Sharding, dims: Sequence[int]) -> Sharding:
    new = [() if i in dims else d for i, d in enumerate(s.dims)]
    return Sharding(tuple(new), s.partial)


@rule(
    aten.scalar_tensor.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
)
def creation(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """No tensor inputs: every rank creates the whole (replicated) value."""
    return Decision({}, Sharding.replicated(out_ndim(node)))


@rule(operator.getitem)
def getitem(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    bound = bind(node)
    return Decision({}, ctx.sh_item(bound.node("self"), bound.literal("index")))
