"""`SpmdLayout`: the per-rank contract of a program that `spmd-partition` produced.

A per-rank program has LOCAL shapes in its signature and collectives as portable ops; its layout
says how those local values relate to the global ones: the mesh, and for every signature input
and output (in signature order) its `Sharding` and global shape, plus the collectives the pass
inserted (what comm-overlap and the backends' reports read). Every runtime that executes a
per-rank program (xla's shard_map, neuron's replica groups, `portable run --nproc`) reads it from
`Program.spmd`.

A program with a layout over a mesh of one device (what `portable run` builds for a single-device
plan) is not per-rank: `is_per_rank` is the one definition, mesh.size > 1.

On disk the layout is the "spmd" entry of the program's metadata document (docs/archive-format.md,
"metadata"), exactly as archives have always stored it; `from_json` reads it as a document from
elsewhere: every field's type, every name, axis and size is checked, and every failure is a
`PlanError` naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import PlanError
from .grammar import bad_identifier, bad_text
from .plan import MAX_DEVICES, Mesh
from .sharding import Sharding
from .signature import Signature

__all__ = ["Collective", "SpmdLayout", "TensorLayout"]

_REDUCE_OPS = frozenset({"sum", "avg", "max", "min"})
_MAX_DIM = 1 << 62  # a dim beyond this is not a real tensor's
_MAX_RANK = 64  # dims of one tensor
_LAYOUT_FIELDS = ("mesh", "inputs", "outputs", "global_shapes", "collectives")
_COLLECTIVE_FIELDS = ("node", "op", "axis", "group_size", "bytes")


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """One signature input or output: its name, its sharding over the mesh and its global shape
    (the local shape is the signature's)."""

    name: str
    sharding: Sharding
    global_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective the partitioner inserted (or comm-overlap bucketed): the node that computes
    it, its op (`all_reduce`, ...), the mesh axis, the ranks in its group, and the bytes each
    rank sends into it (its local input)."""

    node: str
    op: str
    axis: str
    group_size: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SpmdLayout:
    """The mesh, every signature input's and output's layout (signature order) and the
    collectives of a per-rank program (module docstring)."""

    mesh: Mesh
    inputs: tuple[TensorLayout, ...]
    outputs: tuple[TensorLayout, ...]
    collectives: tuple[Collective, ...] = ()

    @staticmethod
    def replicated(signature: Signature, mesh: Mesh) -> SpmdLayout:
        """Every value replicated: the layout of a program that is its own per-rank program."""

        def layouts(specs: Sequence[Any]) -> tuple[TensorLayout, ...]:
            return tuple(
                TensorLayout(s.name, Sharding.replicated(len(s.spec.shape)), _static(s))
                for s in specs
            )

        return SpmdLayout(mesh, layouts(signature.inputs), layouts(signature.outputs))

    @property
    def size(self) -> int:
        """The number of ranks (the mesh's devices)."""
        return self.mesh.size

    @property
    def is_per_rank(self) -> bool:
        """Whether the program runs as more than one rank (mesh.size > 1)."""
        return self.mesh.size > 1

    def input(self, name: str) -> TensorLayout:
        return _find(self.inputs, name, "input")

    def output(self, name: str) -> TensorLayout:
        return _find(self.outputs, name, "output")

    def with_collectives(self, collectives: Sequence[Collective]) -> SpmdLayout:
        return dataclasses.replace(self, collectives=tuple(collectives))

    def to_json(self) -> dict[str, Any]:
        """The metadata "spmd" document (its key order is the archive's)."""
        return {
            "mesh": self.mesh.to_json(),
            "inputs": {t.name: t.sharding.to_json() for t in self.inputs},
            "outputs": {t.name: t.sharding.to_json() for t in self.outputs},
            "global_shapes": {
                "inputs": {t.name: list(t.global_shape) for t in self.inputs},
                "outputs": {t.name: list(t.global_shape) for t in self.outputs},
            },
            "collectives": [c.to_json() for c in self.collectives],
        }

    @staticmethod
    def from_json(data: Any) -> SpmdLayout:
        """The layout of a `to_json` document (PlanError naming what is malformed: layouts come
        from files)."""
        _check_fields(data, _LAYOUT_FIELDS, "a layout")
        if not isinstance(data["mesh"], Mapping):
            raise _bad("mesh is not {axis: size}")
        mesh = Mesh(dict(data["mesh"]))
        shapes = data["global_shapes"]
        _check_fields(shapes, ("inputs", "outputs"), "global_shapes")
        inputs = _tensor_layouts(data["inputs"], shapes["inputs"], mesh, "inputs")
        outputs = _tensor_layouts(data["outputs"], shapes["outputs"], mesh, "outputs")
        if not isinstance(data["collectives"], list):
            raise _bad("collectives is not a list")
        collectives = tuple(_collective(c, mesh) for c in data["collectives"])
        return SpmdLayout(mesh, inputs, outputs, collectives)


def _static(spec: Any) -> tuple[int, ...]:
    shape = spec.spec.shape
    if not all(isinstance(d, int) for d in shape):
        raise PlanError(
            f"`{spec.name}` has dynamic shape {list(shape)}: a per-rank program has static shapes",
            fix="capture the program with static shapes",
        )
    return tuple(int(d) for d in shape)


def _find(layouts: tuple[TensorLayout, ...], name: str, what: str) -> TensorLayout:
    for t in layouts:
        if t.name == name:
            return t
    raise PlanError(
        f"the spmd layout has no {what} `{name}`",
        fix="every signature input and output has one (a bug in the pass that wrote it)",
    )


# --------------------------------------------------------------------------- reading


def _bad(what: str) -> PlanError:
    return PlanError(
        f"malformed spmd layout: {what}",
        fix="the layout is written by the spmd-partition pass; re-run it on the global program",
    )


def _check_fields(data: Any, fields: Sequence[str], what: str) -> None:
    if not isinstance(data, Mapping) or set(data) != set(fields):
        raise _bad(f"{what} is an object with exactly the fields {list(fields)}")


def _tensor_layouts(shardings: Any, shapes: Any, mesh: Mesh, kind: str) -> tuple[TensorLayout, ...]:
    """Signature values: {name: sharding} and {name: global shape}, the same names in order."""
    if not isinstance(shardings, Mapping) or not isinstance(shapes, Mapping):
        raise _bad(f"{kind} and global_shapes.{kind} are not objects")
    if list(shardings) != list(shapes):
        raise _bad(f"{kind} and global_shapes.{kind} name different values")
    out = []
    for name, sharding in shardings.items():
        if (why := bad_text(name, limit=1024)) is not None:
            raise _bad(f"a name in {kind} {why}")
        parsed = _sharding(sharding, mesh, f"{kind}.{name}")
        shape = _shape(shapes[name], f"global_shapes.{kind}.{name}")
        if len(shape) != parsed.ndim:
            raise _bad(
                f"{kind}.{name} shards {parsed.ndim} dims, its global shape {list(shape)} has "
                f"{len(shape)}"
            )
        out.append(TensorLayout(name, parsed, shape))
    return tuple(out)


def _sharding(data: Any, mesh: Mesh, where: str) -> Sharding:
    """{"dims": [[axis, ...] per dim], "partial": {axis: reduce op}}, axes of the mesh."""
    _check_fields(data, ("dims", "partial"), f"{where}")
    dims, partial = data["dims"], data["partial"]
    if not isinstance(dims, list) or len(dims) > _MAX_RANK:
        raise _bad(f"{where}.dims is not a list of at most {_MAX_RANK} dims")
    if not all(isinstance(d, list) and all(isinstance(a, str) for a in d) for d in dims):
        raise _bad(f"{where}.dims is not a list of [axis, ...]")
    if not isinstance(partial, Mapping) or not all(op in _REDUCE_OPS for op in partial.values()):
        raise _bad(f"{where}.partial is not {{axis: {' | '.join(sorted(_REDUCE_OPS))}}}")
    axes = [a for d in dims for a in d] + list(partial)
    for axis in axes:
        if axis not in mesh.names:
            raise _bad(f"{where} names axis {axis!r:.40}; the mesh has {list(mesh.names)}")
    if len(set(axes)) != len(axes):
        raise _bad(f"{where} uses a mesh axis twice: {axes}")
    return Sharding.from_json(data)


def _shape(data: Any, where: str) -> tuple[int, ...]:
    if not isinstance(data, list) or len(data) > _MAX_RANK or not all(_is_size(d) for d in data):
        raise _bad(f"{where} is not a list of at most {_MAX_RANK} sizes")
    return tuple(data)


def _collective(data: Any, mesh: Mesh) -> Collective:
    _check_fields(data, _COLLECTIVE_FIELDS, "a collective")
    for key in ("node", "op"):
        if (why := bad_identifier(data[key])) is not None:
            raise _bad(f"a collective's {key} {why}")
    if data["axis"] not in mesh.names:
        raise _bad(
            f"a collective is over axis {data['axis']!r:.40}; the mesh has {list(mesh.names)}"
        )
    group, nbytes = data["group_size"], data["bytes"]
    if not _is_size(group) or not 1 <= group <= MAX_DEVICES or not _is_size(nbytes):
        raise _bad(f"collective {data['node']}: group_size {group!r:.40} or bytes {nbytes!r:.40}")
    return Collective(data["node"], data["op"], data["axis"], group, nbytes)


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_DIM
