"""The rule protocol: `Decision`, `RuleContext`, the `RULES` table, shared helpers, and the
rules of ops without tensor inputs (creation) and of tuple access (getitem)."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from portable.ir.plan import Mesh
from portable.ir.sharding import Sharding
from portable.opset.bind import bind

__all__ = [
    "RULES",
    "Decision",
    "Key",
    "RuleContext",
    "arg_key",
    "drop_partial",
    "merged_dims",
    "norm_dim",
    "out_ndim",
    "replicate_all",
    "replicated_like",
    "rule",
    "tensor_args",
    "unshard_dims",
]

aten = torch.ops.aten

Key = int | tuple[int, int] | str


@dataclasses.dataclass
class Decision:
    """A rule's answer. `inputs` and `args` are keyed as the walker reads the call: a position in
    `node.args`, a `(position, index)` into a list argument, or a keyword of `node.kwargs`
    (`arg_key` finds the key of a named argument)."""

    inputs: dict[Key, Sharding]
    output: Any  # Sharding, or a tuple of them (None for non-tensor results)
    args: dict[int, Any] = dataclasses.field(default_factory=dict)  # replaced positional args


class RuleContext:
    def __init__(
        self,
        mesh: Mesh,
        sharding: dict,
        shapes: dict,
        dtypes: dict,
        sequence_parallel: str | None = None,
        parameters: frozenset[torch.fx.Node] = frozenset(),
    ) -> None:
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        self._parameters = parameters
        self._sharding = sharding
        self._shapes = shapes
        self._dtypes = dtypes

    def sh(self, node: torch.fx.Node) -> Sharding:
        return self._sharding[node]

    def shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        return self._shapes[node]

    def dtype(self, node: torch.fx.Node) -> torch.dtype:
        return self._dtypes[node]

    def numel(self, node: torch.fx.Node) -> int:
        return math.prod(self.shape(node))

    def is_parameter(self, node: torch.fx.Node) -> bool:
        """Whether `node` is a parameter or a view/cast of one (no activation flows into it)."""
        return node in self._parameters


RULES: dict[Any, Callable[[RuleContext, torch.fx.Node], Decision]] = {}


def rule(*targets):
    def register(fn):
        for t in targets:
            RULES[t] = fn
        return fn

    return register


# --------------------------------------------------------------------------- helpers


def tensor_args(node: torch.fx.Node) -> list[tuple[Key, torch.fx.Node]]:
    out: list[tuple[Key, torch.fx.Node]] = []
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node):
            out.append((i, a))
        elif isinstance(a, (list, tuple)):
            out.extend(((i, j), x) for j, x in enumerate(a) if isinstance(x, torch.fx.Node))
    for k, a in node.kwargs.items():
        if isinstance(a, torch.fx.Node):
            out.append((k, a))
    return out


def arg_key(node: torch.fx.Node, name: str) -> Key | None:
    """Where `node`'s call passes its op's argument `name`: the position in `node.args`, or the
    keyword in `node.kwargs`; None when the call leaves it to its schema default. Positions
    follow the schema as `bind` does (positional arguments in order)."""
    positional = [a.name for a in node.target._schema.arguments if not a.kwarg_only]  # type: ignore[union-attr]
    if name in positional and positional.index(name) < len(node.args):
        return positional.index(name)
    return name if name in node.kwargs else None


def replicated_like(ctx: RuleContext, node: torch.fx.Node) -> Sharding:
    return Sharding.replicated(len(ctx.shape(node)))


def out_ndim(node: torch.fx.Node) -> int:
    return len(node.meta["tensor"].shape)


def replicate_all(ctx: RuleContext, node: torch.fx.Node) -> Decision:
    """The fallback: full copies in, full copy out."""
    inputs = {k: replicated_like(ctx, a) for k, a in tensor_args(node)}
    meta = node.meta["tensor"]
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
def creation(ctx, node):
    """No tensor inputs: every rank creates the whole (replicated) value."""
    return Decision({}, Sharding.replicated(out_ndim(node)))


@rule(operator.getitem)
def getitem(ctx, node):
    bound = bind(node)
    return Decision({}, ctx.sh(bound.node("self"))[bound.literal("index")])
