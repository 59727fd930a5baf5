"""Parallelism plans: a named device mesh and partition specs.

Vocabulary: an *axis* is a mesh axis (`"dp"`, `"tp"`), a *dim* is a tensor dimension. A
`PartitionSpec` has one entry per tensor dim: `None` (replicated along it) or a tuple of mesh axes
that shard it. An empty plan (no mesh) means one device. This module is the data model and its
validation; the `spmd-partition` pass turns a plan into per-rank programs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import PlanError
from .grammar import bad_identifier, bad_text
from .safe_regex import SafePattern, compile_pattern

__all__ = ["MAX_DEVICES", "Mesh", "PartitionSpec", "Plan", "ShardingRule"]

MAX_DEVICES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Mesh:
    """Named mesh axes and their sizes, in major-to-minor order: `Mesh({"dp": 2, "tp": 2})`."""

    axes: tuple[tuple[str, int], ...]

    def __init__(self, axes: Mapping[str, int] | Sequence[tuple[str, int]]) -> None:
        items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)
        for name, size in items:
            if bad_identifier(name) is not None:
                raise PlanError(
                    f"mesh axis name {name!r} is not an identifier", fix="use names like 'dp', 'tp'"
                )
            if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_DEVICES:
                raise PlanError(
                    f"mesh axis {name!r} has size {size!r}",
                    fix=f"sizes are positive integers (a mesh has at most {MAX_DEVICES} devices)",
                )
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise PlanError(f"mesh axes repeat a name: {names}", fix="give each axis its own name")
        if math.prod(s for _, s in items) > MAX_DEVICES:
            raise PlanError(
                f"the mesh has {math.prod(s for _, s in items)} devices, over {MAX_DEVICES}",
                fix="a mesh is at most a million devices; check the axis sizes",
            )
        object.__setattr__(self, "axes", items)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def size(self) -> int:
        return math.prod(s for _, s in self.axes)

    def axis_size(self, name: str) -> int:
        for n, s in self.axes:
            if n == name:
                return s
        raise PlanError(
            f"unknown mesh axis {name!r}",
            fix=f"use one of the mesh's axes: {', '.join(self.names) or '(none)'}",
        )

    def to_json(self) -> dict[str, int]:
        return dict(self.axes)


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """Per tensor dim: None, or the mesh axes sharding that dim (major first)."""

    dims: tuple[tuple[str, ...] | None, ...]

    def __init__(self, *dims: str | Sequence[str] | None) -> None:
        norm = tuple(
            None if d is None else ((d,) if isinstance(d, str) else tuple(d)) for d in dims
        )
        object.__setattr__(self, "dims", norm)

    def axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims if d for a in d)

    def shard_factor(self, mesh: Mesh, dim: int) -> int:
        entry = self.dims[dim] if dim < len(self.dims) else None
        return math.prod(mesh.axis_size(a) for a in entry) if entry else 1

    def to_json(self) -> list[list[str] | None]:
        return [list(d) if d else None for d in self.dims]

    @staticmethod
    def from_json(data: Sequence[Sequence[str] | None]) -> PartitionSpec:
        return PartitionSpec(*[tuple(d) if d else None for d in data])

    def __str__(self) -> str:
        return "(" + ", ".join("*" if d is None else "+".join(d) for d in self.dims) + ")"


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    """A regex over tensor names (parameter fqns, input names) and the spec it assigns.

    The pattern is matched against whole names in linear time (`portable.ir.safe_regex`: no
    backreferences or lookarounds), so no plan can make matching hang."""

    pattern: str
    spec: PartitionSpec
    _compiled: SafePattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", compile_pattern(self.pattern))

    def matches(self, name: str) -> bool:
        return self._compiled.fullmatch(name)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Mesh + explicit per-tensor specs + ordered regex rules (first match wins).

    Tensors with neither are replicated. `Plan()` is the single-device plan."""

    mesh: Mesh | None = None
    specs: tuple[tuple[str, PartitionSpec], ...] = ()
    rules: tuple[ShardingRule, ...] = ()
    # data parallelism: user inputs (the batch) are split on dim 0 over these axes
    batch_axes: tuple[str, ...] = ()
    # FSDP / ZeRO-3: parameters and optimizer state not otherwise sharded are split over this axis
    fsdp_axis: str | None = None
    # sequence parallelism: activations between tensor-parallel regions are split on the
    # sequence dim (1) over this axis instead of replicated
    sequence_parallel: str | None = None

    def __post_init__(self) -> None:
        specs = self.specs.items() if isinstance(self.specs, Mapping) else self.specs
        specs = tuple(
            (name, spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec))
            for name, spec in specs
        )
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "rules", tuple(self.rules))
        axes = (self.batch_axes,) if isinstance(self.batch_axes, str) else self.batch_axes
        object.__setattr__(self, "batch_axes", tuple(axes))
        named = [*self.batch_axes, self.fsdp_axis, self.sequence_parallel]
        named += [a for _, spec in self.specs for a in spec.axes()]
        named += [a for rule in self.rules for a in rule.spec.axes()]
        for axis in named:
            if axis is None:
                continue
            if self.mesh is None:
                raise PlanError(
                    f"plan names mesh axis {axis!r} but has no mesh", fix="pass mesh=Mesh({...})"
                )
            self.mesh.axis_size(axis)  # PlanError naming the axes that exist

    @property
    def is_single_device(self) -> bool:
        return self.mesh is None or self.mesh.size == 1

    def spec_for(self, name: str) -> PartitionSpec | None:
        for tensor, spec in self.specs:
            if tensor == name:
                return spec
        for rule in self.rules:
            if rule.matches(name):
                return rule.spec
        return None

    def validate(self, shapes: Mapping[str, Sequence[int | str]]) -> None:
        """Check every spec against the mesh and the tensor shapes (a dim is an int, or the
        expression of a dynamic dim, which cannot be sharded); raise PlanError with the
        arithmetic on the first problem."""
        if self.mesh is None:
            if self.specs or self.rules:
                raise PlanError("plan has partition specs but no mesh", fix="pass mesh=Mesh({...})")
            return
        for name, _ in self.specs:
            if name not in shapes:
                raise PlanError(
                    f"plan names tensor {name!r}, which the program does not have",
                    fix="use a parameter fqn or input name from `portable inspect`",
                )
        for rule in self.rules:
            if not any(rule.matches(n) for n in shapes):
                raise PlanError(
                    f"sharding rule {rule.pattern!r} matches no tensor",
                    fix="check the regex against the names `portable inspect` lists",
                )
        for name, shape in shapes.items():
            spec = self.spec_for(name)
            if spec is not None:
                self._check(name, tuple(shape), spec)

    def _check(self, name: str, shape: tuple[int | str, ...], spec: PartitionSpec) -> None:
        assert self.mesh is not None
        if len(spec.dims) > len(shape):
            raise PlanError(
                f"spec {spec} has {len(spec.dims)} dims but {name} has {len(shape)} ({list(shape)})",
                fix="give one entry per tensor dim",
            )
        used = spec.axes()
        if len(set(used)) != len(used):
            raise PlanError(f"spec {spec} for {name} uses a mesh axis twice")
        for dim, entry in enumerate(spec.dims):
            if not entry:
                continue
            factor, size = spec.shard_factor(self.mesh, dim), shape[dim]
            axes = "*".join(f"{a}({self.mesh.axis_size(a)})" for a in entry)
            if isinstance(size, str):
                raise PlanError(
                    f"{axes} shards {name} dim {dim}, which is dynamic ({size})",
                    fix="shard a static dim, or capture with a static size for this one",
                )
            if size % factor:
                raise PlanError(
                    f"{axes} does not divide {name} dim {dim} ({size}): "
                    f"{size} % {factor} = {size % factor}",
                    fix="change the mesh sizes or shard another dim",
                )

    def check_world_size(self, world_size: int, launcher: str) -> None:
        """PlanError unless the launcher starts exactly one process per mesh position."""
        size = self.mesh.size if self.mesh else 1
        if world_size != size:
            axes = " x ".join(f"{n}={s}" for n, s in self.mesh.axes) if self.mesh else "one device"
            raise PlanError(
                f"{launcher} starts {world_size} processes but the plan's mesh ({axes}) has "
                f"{size} positions",
                fix=f"launch {size} processes (--nproc {size}) or change the mesh",
            )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "mesh": self.mesh.to_json() if self.mesh else None,
            "specs": {name: spec.to_json() for name, spec in self.specs},
            "rules": [{"pattern": r.pattern, "spec": r.spec.to_json()} for r in self.rules],
        }
        if self.batch_axes:
            data["batch_axes"] = list(self.batch_axes)
        if self.fsdp_axis:
            data["fsdp_axis"] = self.fsdp_axis
        if self.sequence_parallel:
            data["sequence_parallel"] = self.sequence_parallel
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any] | None) -> Plan:
        """The plan of a `to_json` document (PlanError naming what is malformed: plans come
        from files)."""
        if not data:
            return Plan()
        if not isinstance(data, Mapping) or set(data) - _PLAN_FIELDS:
            raise _bad_plan(f"a plan is an object with fields {sorted(_PLAN_FIELDS)}")
        mesh = data.get("mesh")
        if mesh is not None and not isinstance(mesh, Mapping):
            raise _bad_plan("mesh is not {axis: size}")
        specs, rules = data.get("specs", {}), data.get("rules", [])
        if not isinstance(specs, Mapping) or not isinstance(rules, list):
            raise _bad_plan("specs is not {tensor: spec} or rules is not a list")
        for name in specs:
            if (why := bad_text(name, limit=1024)) is not None:
                raise _bad_plan(f"a tensor name in specs {why}")
        for rule in rules:
            if not isinstance(rule, Mapping) or set(rule) != {"pattern", "spec"}:
                raise _bad_plan("a rule is not {pattern, spec}")
        batch = data.get("batch_axes", [])
        if not isinstance(batch, list) or not all(isinstance(a, str) for a in batch):
            raise _bad_plan("batch_axes is not a list of axis names")
        for key in ("fsdp_axis", "sequence_parallel"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise _bad_plan(f"{key} is not an axis name")
        return Plan(
            Mesh(dict(mesh)) if mesh else None,
            tuple((k, _spec_from_json(v)) for k, v in specs.items()),
            tuple(ShardingRule(r["pattern"], _spec_from_json(r["spec"])) for r in rules),
            batch_axes=tuple(batch),
            fsdp_axis=data.get("fsdp_axis"),
            sequence_parallel=data.get("sequence_parallel"),
        )


_PLAN_FIELDS = frozenset({"mesh", "specs", "rules", "batch_axes", "fsdp_axis", "sequence_parallel"})


def _bad_plan(what: str) -> PlanError:
    return PlanError(f"malformed plan: {what}", fix="write the plan with Plan.to_json()")


def _spec_from_json(data: Any) -> PartitionSpec:
    """A partition spec: one entry per dim, null or a list of axis names."""
    if not isinstance(data, list) or not all(
        d is None or isinstance(d, list) and all(isinstance(a, str) for a in d) for d in data
    ):
        raise _bad_plan(f"a partition spec is a list of null or [axis, ...], got {data!r:.80}")
    return PartitionSpec.from_json(data)
