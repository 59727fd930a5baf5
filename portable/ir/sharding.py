"""How one tensor of a per-rank program is laid out over the mesh: the contract between the
`spmd-partition` pass and every runtime that executes per-rank programs.

A `Sharding` has one entry per tensor dim, the mesh axes that split that dim (major first: the
chunk a rank holds is the row-major index of its coordinates on those axes), plus the axes over
which the local value is a *partial* result still to be reduced (`("dp", "sum")`). An axis neither
splits a dim nor is partial: the tensor is replicated along it.

Ranks are numbered row-major over the mesh axes in their declared order (the last axis is
contiguous). `Mesh.group(axis, rank)` is the ranks a collective over `axis` spans.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import PlanError
from .plan import Mesh, PartitionSpec

__all__ = ["Sharding", "coords_of", "group_of", "groups_of", "rank_of", "shard", "unshard"]


@dataclasses.dataclass(frozen=True)
class Sharding:
    dims: tuple[tuple[str, ...], ...]
    partial: tuple[tuple[str, str], ...] = ()  # (axis, reduce_op), sorted by axis

    @staticmethod
    def replicated(ndim: int) -> Sharding:
        return Sharding(((),) * ndim)

    @staticmethod
    def from_spec(spec: PartitionSpec | None, ndim: int) -> Sharding:
        dims = [tuple(d) if d else () for d in (spec.dims if spec else ())]
        return Sharding(tuple(dims + [()] * (ndim - len(dims))))

    def to_spec(self) -> PartitionSpec:
        return PartitionSpec(*[d or None for d in self.dims])

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def axes(self) -> tuple[str, ...]:
        """Axes that split some dim."""
        return tuple(a for d in self.dims for a in d)

    def dim_of(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def partial_op(self, axis: str) -> str | None:
        return dict(self.partial).get(axis)

    @property
    def is_replicated(self) -> bool:
        return not self.axes() and not self.partial

    def with_dims(self, dims: Sequence[Sequence[str]]) -> Sharding:
        return Sharding(tuple(tuple(d) for d in dims), self.partial)

    def with_partial(self, partial: Mapping[str, str]) -> Sharding:
        return Sharding(self.dims, tuple(sorted(partial.items())))

    def factor(self, mesh: Mesh, dim: int) -> int:
        return math.prod(mesh.axis_size(a) for a in self.dims[dim])

    def local_shape(self, shape: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        out = []
        for dim, size in enumerate(shape):
            factor = self.factor(mesh, dim)
            if size % factor:
                raise PlanError(
                    f"{'*'.join(self.dims[dim])} ({factor}) does not divide dim {dim} "
                    f"({size}): {size} % {factor} = {size % factor}",
                    fix="change the mesh sizes or shard another dim",
                )
            out.append(size // factor)
        return tuple(out)

    def global_shape(self, local: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
        return tuple(s * self.factor(mesh, d) for d, s in enumerate(local))

    def to_json(self) -> dict[str, Any]:
        return {"dims": [list(d) for d in self.dims], "partial": dict(self.partial)}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Sharding:
        return Sharding(
            tuple(tuple(d) for d in data["dims"]), tuple(sorted(data.get("partial", {}).items()))
        )

    def __str__(self) -> str:
        body = ", ".join("+".join(d) if d else "*" for d in self.dims)
        partial = "".join(f" partial[{a}:{op}]" for a, op in self.partial)
        return f"({body}){partial}"


# --------------------------------------------------------------------------- ranks and groups


def coords_of(mesh: Mesh, rank: int) -> dict[str, int]:
    """Mesh coordinates of a global rank (row-major, last axis contiguous)."""
    if not 0 <= rank < mesh.size:
        raise PlanError(f"rank {rank} is outside a mesh of {mesh.size} ranks")
    coords = {}
    for name, size in reversed(mesh.axes):
        coords[name] = rank % size
        rank //= size
    return {name: coords[name] for name in mesh.names}


def rank_of(mesh: Mesh, coords: Mapping[str, int]) -> int:
    rank = 0
    for name, size in mesh.axes:
        rank = rank * size + coords[name]
    return rank


def group_of(mesh: Mesh, axis: str, rank: int) -> list[int]:
    """The ranks a collective over `axis` spans for `rank`, ordered by their coordinate on it."""
    coords = coords_of(mesh, rank)
    return [rank_of(mesh, {**coords, axis: i}) for i in range(mesh.axis_size(axis))]


def groups_of(mesh: Mesh, axis: str) -> list[list[int]]:
    """Every group of `axis` (each rank in exactly one), ordered by their first rank."""
    seen: dict[tuple[int, ...], None] = {}
    for rank in range(mesh.size):
        seen.setdefault(tuple(group_of(mesh, axis, rank)), None)
    return [list(g) for g in seen]


# --------------------------------------------------------------------------- global <-> local


def _chunk_index(sharding: Sharding, mesh: Mesh, dim: int, coords: Mapping[str, int]) -> int:
    index = 0
    for axis in sharding.dims[dim]:
        index = index * mesh.axis_size(axis) + coords[axis]
    return index


def shard(value: torch.Tensor, sharding: Sharding, mesh: Mesh, rank: int) -> torch.Tensor:
    """The local value `rank` holds of the global `value` (partial axes: rank 0 of the group
    holds the value, the others the reduction's identity, so the reduction gives it back)."""
    coords = coords_of(mesh, rank)
    local = value
    for dim in range(sharding.ndim):
        if sharding.dims[dim]:
            factor = sharding.factor(mesh, dim)
            size = local.shape[dim] // factor
            local = local.narrow(dim, _chunk_index(sharding, mesh, dim, coords) * size, size)
    for axis, op in sharding.partial:
        if coords[axis] != 0:
            if op != "sum":
                raise PlanError(f"cannot shard a value that is partial[{op}] on {axis}")
            local = torch.zeros_like(local)
    return local.contiguous()


def unshard(locals_: Sequence[torch.Tensor], sharding: Sharding, mesh: Mesh) -> torch.Tensor:
    """The global value from every rank's local value (`locals_[rank]`): shards concatenated,
    partial values reduced. Replicated copies are taken from the lowest rank."""
    if len(locals_) != mesh.size:
        raise PlanError(f"unshard needs {mesh.size} local values, got {len(locals_)}")
    # reduce partial axes first: combine over each partial axis's group
    values = list(locals_)
    for axis, op in sharding.partial:
        reduced = list(values)
        for group in groups_of(mesh, axis):
            stack = torch.stack([values[r] for r in group])
            if op == "sum":
                total = stack.sum(0)
            elif op == "avg":
                total = stack.mean(0)
            elif op == "max":
                total = stack.amax(0)
            elif op == "min":
                total = stack.amin(0)
            else:
                raise PlanError(f"unknown reduce op {op!r}")
            for r in group:
                reduced[r] = total
        values = reduced
    return _assemble(values, sharding, mesh)


def _assemble(values: Sequence[torch.Tensor], sharding: Sharding, mesh: Mesh) -> torch.Tensor:
    """Place every rank's chunk at its offset in a global tensor."""
    local_shape = values[0].shape
    shape = sharding.global_shape(tuple(local_shape), mesh)
    out = values[0].new_empty(shape)
    for rank in range(mesh.size):
        coords = coords_of(mesh, rank)
        view = out
        for dim in range(sharding.ndim):
            if sharding.dims[dim]:
                index = _chunk_index(sharding, mesh, dim, coords)
                view = view.narrow(dim, index * local_shape[dim], local_shape[dim])
        view.copy_(values[rank])
    return out
