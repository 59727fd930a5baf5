"""The shardings a plan gives the program's inputs and requires of its outputs.

- parameters and buffers: the plan's spec for their name (explicit specs, then regex rules);
  with `fsdp_axis`, a parameter not already split over that axis is split over it too, on its
  first dim that the axis divides (the axis goes minor-most, so gathering it gives back the
  tensor-parallel shard);
- optimizer state: the sharding of the parameter it belongs to (the step counter: replicated);
- user inputs: dim 0 split over `batch_axes` and, under context parallelism, dim 1 (the
  sequence) of those with two or more dims over `context_axis` (or the plan's spec for their
  name);
- outputs: the loss replicated; an updated value the sharding of the input it replaces;
  inference outputs keep their natural split.
"""

from __future__ import annotations

from portable.errors import PlanError
from portable.ir.plan import Mesh, Plan
from portable.ir.program import Program
from portable.ir.sharding import Sharding
from portable.ir.signature import InputKind, InputSpec

__all__ = ["input_shardings"]

_OPT_PREFIX = "optimizer."


def _param_of_state(target: str, params: set[str]) -> str | None:
    body = target.removeprefix(_OPT_PREFIX)
    head, _, _ = body.rpartition(".")
    return head if head in params else None


def _spec_sharding(
    plan: Plan, mesh: Mesh, name: str, shape: tuple[int, ...], aliases: tuple[str, ...] = ()
) -> Sharding:
    spec = plan.spec_for(name)
    for alias in aliases:  # tied weights: a spec for either name applies
        spec = spec if spec is not None else plan.spec_for(alias)
    if spec is not None and len(spec.dims) > len(shape):
        raise PlanError(
            f"spec {spec} has {len(spec.dims)} dims but {name} has {len(shape)} ({list(shape)})",
            fix="give one entry per tensor dim",
        )
    sharding = Sharding.from_spec(spec, len(shape))
    sharding.local_shape(shape, mesh)  # PlanError with the arithmetic
    return sharding


def _with_fsdp(
    plan: Plan, mesh: Mesh, sharding: Sharding, shape: tuple[int, ...], notes: list[str], name: str
) -> Sharding:
    axis = plan.fsdp_axis
    if axis is None or axis in sharding.axes():
        return sharding
    size = mesh.axis_size(axis)
    for d in range(len(shape)):
        local = shape[d] // sharding.factor(mesh, d)
        if local % size == 0 and local >= size:
            dims = list(sharding.dims)
            dims[d] = dims[d] + (axis,)
            return Sharding(tuple(dims))
    notes.append(f"fsdp: {name} {list(shape)} kept whole ({axis}={size} divides no dim)")
    return sharding


def input_shardings(program: Program, notes: list[str]) -> dict[str, Sharding]:
    """Placeholder name -> its sharding under `program.plan`."""
    plan, mesh = program.plan, program.plan.mesh
    assert mesh is not None, "spmd-partition partitions only multi-device plans"
    sig = program.signature
    params = {i.key for i in sig.inputs_of(InputKind.PARAMETER)}
    out: dict[str, Sharding] = {}
    by_param: dict[str, Sharding] = {}
    tied: dict[str, tuple[str, ...]] = {}
    for dropped, kept in program.metadata.get("tied_weights", {}).items():
        tied[kept] = (*tied.get(kept, ()), dropped)
    for spec in sig.inputs:
        shape = tuple(int(s) for s in spec.spec.shape)
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT):
            name = spec.target or spec.name
            s = _spec_sharding(plan, mesh, name, shape, tied.get(name, ()))
            if spec.kind is InputKind.PARAMETER:
                s = _with_fsdp(plan, mesh, s, shape, notes, name)
                by_param[spec.key] = s
            out[spec.name] = s
        elif spec.kind is InputKind.OPTIMIZER_STATE:
            owner = _param_of_state(spec.key, params)
            out[spec.name] = (
                by_param.get(owner, Sharding.replicated(len(shape)))
                if owner
                else Sharding.replicated(len(shape))
            )
        else:
            out[spec.name] = _user_input(plan, mesh, spec, shape, _micro_batches(program))
    return out


def _micro_batches(program: Program) -> int:
    """How many micro-batches a training step splits its batch into (recipe.accumulate)."""
    recipe = program.metadata.get("recipe")
    return int(recipe.get("accumulate", 1)) if isinstance(recipe, dict) else 1


def _user_input(
    plan: Plan, mesh: Mesh, spec: InputSpec, shape: tuple[int, ...], micro_batches: int = 1
) -> Sharding:
    if plan.spec_for(spec.name) is not None:
        return _spec_sharding(plan, mesh, spec.name, shape)
    batch = _batch_split(plan, mesh, spec, shape, micro_batches)
    context = _context_split(plan, mesh, spec, shape)
    if context is None:
        return batch
    return Sharding(batch.dims[:1] + ((context,),) + batch.dims[2:])


def _context_split(plan: Plan, mesh: Mesh, spec: InputSpec, shape: tuple[int, ...]) -> str | None:
    """Context parallelism: the axis splitting dim 1 (the sequence) of a user input of two or
    more dims, None for other inputs and plans."""
    axis = plan.context_axis
    if axis is None or len(shape) < 2:
        return None
    size = mesh.axis_size(axis)
    if shape[1] % size:
        raise PlanError(
            f"{axis}({size}) does not divide input {spec.name} dim 1 ({shape[1]}): "
            f"{shape[1]} % {size} = {shape[1] % size}",
            fix=f"use a sequence length that is a multiple of {size}, or change the mesh",
        )
    return axis


def _batch_split(
    plan: Plan, mesh: Mesh, spec: InputSpec, shape: tuple[int, ...], micro_batches: int
) -> Sharding:
    if not plan.batch_axes or not shape:
        return Sharding.replicated(len(shape))
    factor = 1
    for axis in plan.batch_axes:
        factor *= mesh.axis_size(axis)
    axes = "*".join(f"{a}({mesh.axis_size(a)})" for a in plan.batch_axes)
    if shape[0] % factor:
        raise PlanError(
            f"batch axes {axes} do not divide input {spec.name} dim 0 ({shape[0]}): "
            f"{shape[0]} % {factor} = {shape[0] % factor}",
            fix=f"use a batch size that is a multiple of {factor}, or change the mesh",
        )
    if (shape[0] // micro_batches) % factor:
        rows = shape[0] // micro_batches
        raise PlanError(
            f"batch axes {axes} do not divide the micro-batches of input {spec.name}: "
            f"{shape[0]} rows / accumulate {micro_batches} = {rows}, {rows} % {factor} = "
            f"{rows % factor}",
            fix=f"use a batch size that is a multiple of {factor * micro_batches} "
            f"(batch axes {factor} x accumulate {micro_batches}), or accumulate less",
        )
    return Sharding((tuple(plan.batch_axes),) + ((),) * (len(shape) - 1))
