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

__all__ = [
    "MAX_DEVICES",
    "SCHEDULES",
    "Experts",
    "Mesh",
    "PartitionSpec",
    "Pipeline",
    "Plan",
    "ShardingRule",
]

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


SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism over mesh axis `axis`: the training step is cut at layer boundaries
    into `stages` programs (`virtual_stages` per rank of `axis`; rank r holds stages r, r + pp,
    ..., as torch.distributed.pipelining's interleaved schedules place them), each run on
    `microbatches` micro-batches per step under `schedule`.

    `split_points` are the module paths where stages 1, 2, ... begin (`"blocks.4"`); empty
    means balanced by the cost model over the model's layers."""

    axis: str = "pp"
    stages: int | None = None  # None: the axis size times virtual_stages
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    split_points: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_points", _names(self.split_points, "split_points"))
        if self.schedule not in SCHEDULES:
            raise PlanError(
                f"unknown pipeline schedule {self.schedule!r}",
                fix=f"use one of {', '.join(SCHEDULES)}",
            )
        fields = ("microbatches", "virtual_stages")
        for field in fields + (("stages",) if self.stages is not None else ()):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(
                    f"pipeline {field} is {value!r}", fix=f"{field} is a positive integer"
                )
        if self.schedule == "interleaved-1f1b" and self.virtual_stages < 2:
            raise PlanError(
                "the interleaved-1f1b schedule needs virtual_stages >= 2 (got 1)",
                fix="set virtual_stages=2 (two stages per rank), or use schedule='1f1b'",
            )
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages != 1:
            raise PlanError(
                f"the {self.schedule} schedule runs one stage per rank, but virtual_stages="
                f"{self.virtual_stages}",
                fix="use schedule='interleaved-1f1b' (or 'zero-bubble') for several stages per rank",
            )
        if (
            self.stages is not None
            and self.split_points
            and len(self.split_points) != self.stages - 1
        ):
            raise PlanError(
                f"{len(self.split_points)} split points make {len(self.split_points) + 1} stages, "
                f"but stages={self.stages}",
                fix=f"name {self.stages - 1} module paths where stages 1..{self.stages - 1} begin",
            )

    def stage_count(self, mesh: Mesh) -> int:
        """The number of stages: `stages`, checked against the axis size x virtual_stages."""
        expected = mesh.axis_size(self.axis) * self.virtual_stages
        if self.stages is not None and self.stages != expected:
            raise PlanError(
                f"pipeline stages={self.stages} but {self.axis}({mesh.axis_size(self.axis)}) x "
                f"virtual_stages({self.virtual_stages}) = {expected}",
                fix=f"set stages={expected}, or change the {self.axis} size or virtual_stages",
            )
        return expected

    def check(self, mesh: Mesh) -> None:
        """PlanError with the arithmetic unless the schedule can run on `mesh`."""
        pp, stages = mesh.axis_size(self.axis), self.stage_count(mesh)
        if self.split_points and len(self.split_points) != stages - 1:
            raise PlanError(
                f"{len(self.split_points)} split points make {len(self.split_points) + 1} stages, "
                f"but {self.axis}({pp}) x virtual_stages({self.virtual_stages}) = {stages}",
                fix=f"name {stages - 1} module paths where stages 1..{stages - 1} begin",
            )
        if self.schedule != "gpipe" and self.microbatches < pp:
            raise PlanError(
                f"the {self.schedule} schedule needs at least one micro-batch per "
                f"{self.axis} rank: microbatches={self.microbatches} < {self.axis}({pp})",
                fix=f"set microbatches >= {pp} (a bubble of (p-1)/(m+p-1) wants m >> p)",
            )
        if self.virtual_stages > 1 and self.microbatches % pp:
            raise PlanError(
                f"{self.schedule} with virtual stages runs micro-batches in rounds of "
                f"{self.axis}({pp}): {self.microbatches} % {pp} = {self.microbatches % pp}",
                fix=f"use a multiple of {pp} micro-batches",
            )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "axis": self.axis,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
        }
        if self.stages is not None:
            data["stages"] = self.stages
        if self.split_points:
            data["split_points"] = list(self.split_points)
        return data

    @staticmethod
    def from_json(data: Any) -> Pipeline:
        fields = {"axis", "stages", "schedule", "microbatches", "virtual_stages", "split_points"}
        if not isinstance(data, Mapping) or set(data) - fields:
            raise _bad_plan(f"pipeline is an object with fields {sorted(fields)}")
        if not isinstance(data.get("axis", "pp"), str) or not isinstance(
            data.get("schedule", "1f1b"), str
        ):
            raise _bad_plan("pipeline axis and schedule are strings")
        points = data.get("split_points", [])
        if not isinstance(points, list):
            raise _bad_plan("pipeline split_points is a list of module paths")
        return Pipeline(
            axis=data.get("axis", "pp"),
            stages=data.get("stages"),
            schedule=data.get("schedule", "1f1b"),
            microbatches=data.get("microbatches", 1),
            virtual_stages=data.get("virtual_stages", 1),
            split_points=tuple(points),
        )


@dataclasses.dataclass(frozen=True)
class Experts:
    """Expert parallelism over mesh axis `axis`: the experts of every mixture-of-experts layer
    whose module path matches `modules` are split over the axis, tokens dispatched to the rank
    holding their expert with all-to-all and combined back. `capacity_factor` None drops no
    token; a number caps each expert at ceil(factor x tokens x top_k / experts) tokens, as the
    model's own capacity factor would."""

    axis: str = "ep"
    modules: str = r".*"
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        compile_pattern(self.modules)  # PlanError for a pattern the safe matcher refuses
        factor = self.capacity_factor
        if factor is not None and (
            not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0
        ):
            raise PlanError(
                f"experts capacity_factor is {factor!r}",
                fix="a positive number, or None to drop no token",
            )

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"axis": self.axis, "modules": self.modules}
        if self.capacity_factor is not None:
            data["capacity_factor"] = self.capacity_factor
        return data

    @staticmethod
    def from_json(data: Any) -> Experts:
        fields = {"axis", "modules", "capacity_factor"}
        if not isinstance(data, Mapping) or set(data) - fields:
            raise _bad_plan(f"experts is an object with fields {sorted(fields)}")
        if not isinstance(data.get("axis", "ep"), str) or not isinstance(
            data.get("modules", ".*"), str
        ):
            raise _bad_plan("experts axis and modules are strings")
        return Experts(
            axis=data.get("axis", "ep"),
            modules=data.get("modules", r".*"),
            capacity_factor=data.get("capacity_factor"),
        )


def _names(values: Any, field: str) -> tuple[str, ...]:
    if isinstance(values, str):
        values = (values,)
    if not isinstance(values, (tuple, list)):
        raise PlanError(f"pipeline {field} is {values!r:.80}", fix="give a list of module paths")
    values = tuple(values)
    for value in values:
        if not isinstance(value, str) or bad_text(value, limit=1024) is not None:
            raise PlanError(f"pipeline {field} holds {value!r:.80}", fix="give module paths")
    return values


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
    # pipeline parallelism: the step cut into stages over `pipeline.axis`
    pipeline: Pipeline | None = None
    # expert parallelism: mixture-of-experts layers' experts split over `experts.axis`
    experts: Experts | None = None
    # context parallelism: every activation's sequence dim split over this axis; ring attention
    context_axis: str | None = None

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
        named = [*self.batch_axes, self.fsdp_axis, self.sequence_parallel, self.context_axis]
        named += [self.pipeline.axis if self.pipeline else None]
        named += [self.experts.axis if self.experts else None]
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
        if self.pipeline is not None and self.mesh is not None:
            self.pipeline.check(self.mesh)
            spec_axes = [a for _, spec in self.specs for a in spec.axes()]
            spec_axes += [a for rule in self.rules for a in rule.spec.axes()]
            reused = {*self.batch_axes, self.fsdp_axis, self.sequence_parallel, *spec_axes}
            reused |= {self.context_axis, self.experts.axis if self.experts else None}
            if self.pipeline.axis in reused:
                raise PlanError(
                    f"mesh axis {self.pipeline.axis!r} is the pipeline axis and also splits "
                    "tensors or the batch",
                    fix="give the pipeline an axis of its own (Mesh({'pp': 2, 'dp': 2}))",
                )

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
        if self.pipeline:
            data["pipeline"] = self.pipeline.to_json()
        if self.experts:
            data["experts"] = self.experts.to_json()
        if self.context_axis:
            data["context_axis"] = self.context_axis
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
        for key in ("fsdp_axis", "sequence_parallel", "context_axis"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise _bad_plan(f"{key} is not an axis name")
        return Plan(
            Mesh(dict(mesh)) if mesh else None,
            tuple((k, _spec_from_json(v)) for k, v in specs.items()),
            tuple(ShardingRule(r["pattern"], _spec_from_json(r["spec"])) for r in rules),
            batch_axes=tuple(batch),
            fsdp_axis=data.get("fsdp_axis"),
            sequence_parallel=data.get("sequence_parallel"),
            pipeline=_optional(data, "pipeline", Pipeline.from_json),
            experts=_optional(data, "experts", Experts.from_json),
            context_axis=data.get("context_axis"),
        )


_PLAN_FIELDS = frozenset(
    {
        "mesh",
        "specs",
        "rules",
        "batch_axes",
        "fsdp_axis",
        "sequence_parallel",
        "pipeline",
        "experts",
        "context_axis",
    }
)


def _optional(data: Mapping[str, Any], key: str, read: Any) -> Any:
    """`read(data[key])`, or None when the key is absent or null (a present value of the wrong
    type is refused by `read`, never taken as absent)."""
    return read(data[key]) if data.get(key, None) is not None else None


def _bad_plan(what: str) -> PlanError:
    return PlanError(f"malformed plan: {what}", fix="write the plan with Plan.to_json()")


def _spec_from_json(data: Any) -> PartitionSpec:
    """A partition spec: one entry per dim, null or a list of axis names."""
    if not isinstance(data, list) or not all(
        d is None or isinstance(d, list) and all(isinstance(a, str) for a in d) for d in data
    ):
        raise _bad_plan(f"a partition spec is a list of null or [axis, ...], got {data!r:.80}")
    return PartitionSpec.from_json(data)
