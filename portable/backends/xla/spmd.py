"""XLA multi-device execution of per-rank programs: one rank per XLA device, under `jax.shard_map`.

A per-rank program (what the spmd-partition pass produces, see `portable/ir/sharding.py`) has
LOCAL shapes in its signature, collectives as portable ops, and a layout (`Program.spmd`, a
`portable.ir.spmd.SpmdLayout`) with the mesh and the `Sharding` of every signature input and
output. Here it runs on N = mesh.size XLA devices:

- mesh: `jax.sharding.Mesh(devices[:N].reshape(mesh sizes), mesh axis names)`: device k is rank k
  (ranks are row-major over the mesh axes, as in `portable.ir.sharding`);
- in/out specs: each `Sharding` as a `jax.sharding.PartitionSpec` (dims split by the same axes,
  major first; replicated axes absent), so the device of rank r holds exactly
  `shard(global, sharding, mesh, r)` and the global output is `unshard(...)`;
- collectives lower to XLA's over the named axis (`NamedAxisCollectives` in
  rules/portable_ops.py): all_reduce -> psum / pmean / pmax / pmin; all_gather ->
  all_gather(tiled); reduce_scatter -> psum_scatter(tiled) (max/min: all-reduce then this rank's
  chunk); all_to_all -> all_to_all(tiled); local_shard -> axis_index + dynamic_slice; wait ->
  identity.

The contract of `portable.compile(per_rank_program, backend="xla")` when the program is per-rank
(`Program.is_per_rank`: a layout over more than one rank): the Executable takes and returns
GLOBAL values. User inputs are checked against the layout's global shapes, the state it holds
(`exe.state`, initialised from `program.weights`) is global, and outputs are global; every call
shards the inputs onto the devices and gathers the outputs. `run_spmd(program, global_inputs,
steps)` is the lower-level form that keeps a training step's state on the devices between steps
(updated outputs replace the inputs they alias, donated, never gathered) and gathers once at the
end. Outputs replicated over an axis are taken from the lowest rank, as `unshard` does.

XLA:CPU needs `--xla_force_host_platform_device_count=N` (or more) in XLA_FLAGS before JAX
initialises; tests/conftest.py sets 8.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from portable.errors import BackendError, InputError, PlanError
from portable.ir.plan import Mesh
from portable.ir.program import Program, ProgramKind
from portable.ir.sharding import Sharding
from portable.ir.signature import OutputKind, TensorSpec
from portable.ir.spmd import SpmdLayout
from portable.runtime import Executable, _check_signature

from .compiler import compile_lowered

if TYPE_CHECKING:
    import jax

__all__ = [
    "SpmdExecutable",
    "SpmdResult",
    "jax_mesh",
    "layout_of",
    "partition_spec",
    "run_spmd",
    "spmd_function",
    "to_torch",
]


def layout_of(program: Program) -> SpmdLayout:
    """The layout of a per-rank program, whose signature values are not partial (PlanError
    otherwise: the verifier has checked the rest)."""
    layout = program.spmd
    if layout is None:
        raise PlanError(
            f"{program.name} is not a per-rank program (it has no spmd layout)",
            fix="apply the spmd-partition pass to a program with a plan",
        )
    for kind, tensors in (("input", layout.inputs), ("output", layout.outputs)):
        for t in tensors:
            if t.sharding.partial:
                raise PlanError(
                    f"{kind} `{t.name}` is partial over {dict(t.sharding.partial)}",
                    fix="signature values must be reduced before they leave the program",
                )
    return layout


def partition_spec(sharding: Sharding) -> jax.sharding.PartitionSpec:
    """The jax PartitionSpec of a Sharding without partial axes."""
    from jax.sharding import PartitionSpec as P

    return P(*[(d[0] if len(d) == 1 else tuple(d)) if d else None for d in sharding.dims])


def jax_mesh(mesh: Mesh, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """`jax.sharding.Mesh` over the first mesh.size of `devices` (default: the XLA CPU
    devices); device k is rank k."""
    import jax
    import numpy as np

    devices = list(devices) if devices is not None else jax.devices("cpu")
    if len(devices) < mesh.size:
        kind = devices[0].platform.upper() if devices else "CPU"
        raise BackendError(
            f"the mesh {mesh.to_json()} has {mesh.size} ranks, XLA has {len(devices)} {kind} "
            "device(s)",
            fix=f"set XLA_FLAGS=--xla_force_host_platform_device_count={mesh.size} (or more) "
            "before JAX initialises",
        )
    grid = np.array(devices[: mesh.size], dtype=object).reshape([s for _, s in mesh.axes])
    return jax.sharding.Mesh(grid, mesh.names)


class _SpmdFunction:
    """The per-rank program as one jitted shard_map over the mesh, on global jax arrays."""

    def __init__(
        self,
        program: Program,
        platform: str = "xla",
        devices: Sequence[Any] | None = None,
        rules: Mapping[Any, Callable[..., Any]] | None = None,
    ) -> None:
        import jax

        from .lowering import abstract_inputs, donated, jax_function
        from .rules.portable_ops import NamedAxisCollectives

        self.program = program
        self.layout = layout = layout_of(program)
        self.mesh = jax_mesh(layout.mesh, devices)
        sharding = jax.sharding.NamedSharding
        self.in_shardings = [sharding(self.mesh, partition_spec(t.sharding)) for t in layout.inputs]
        self.out_shardings = [
            sharding(self.mesh, partition_spec(t.sharding)) for t in layout.outputs
        ]
        body = jax.shard_map(
            jax_function(program, platform, NamedAxisCollectives(), rules),
            mesh=self.mesh,
            in_specs=tuple(partition_spec(t.sharding) for t in layout.inputs),
            out_specs=tuple(partition_spec(t.sharding) for t in layout.outputs),
            # replicated outputs are taken from one device; their equality is the pass's contract
            check_vma=False,
        )
        local = abstract_inputs(program)
        glob = [
            jax.ShapeDtypeStruct(t.global_shape, a.dtype, sharding=s)
            for t, a, s in zip(layout.inputs, local, self.in_shardings, strict=True)
        ]
        self.donated = donated(program)
        with jax.enable_x64(True):
            jitted = jax.jit(
                body, donate_argnums=self.donated, out_shardings=tuple(self.out_shardings)
            )
            self.lowered = jitted.lower(*glob)
            self.compiled = compile_lowered(self.lowered)

    def put(self, values: Sequence[torch.Tensor]) -> list:
        """Global torch tensors -> global jax arrays laid out over the mesh (fresh buffers)."""
        import jax
        import jax.numpy as jnp

        with jax.enable_x64(True):
            return [
                jax.device_put(jnp.from_dlpack(v.detach().contiguous()), s, may_alias=False)
                for v, s in zip(values, self.in_shardings, strict=True)
            ]

    def put_one(self, index: int, value: torch.Tensor) -> Any:
        """The global torch tensor of signature input `index` as a jax array over the mesh."""
        import jax
        import jax.numpy as jnp

        with jax.enable_x64(True):
            array = jnp.from_dlpack(value.detach().contiguous())
            return jax.device_put(array, self.in_shardings[index], may_alias=False)

    def __call__(self, arrays: Sequence[Any]) -> list:
        import jax

        with jax.enable_x64(True):
            return list(self.compiled(*arrays))

    def thread(self, arrays: list, outputs: Sequence[Any]) -> list:
        """The next step's inputs: each updated output replaces the input it aliases."""
        import jax

        sig = self.program.signature
        index = {spec.name: k for k, spec in enumerate(sig.inputs)}
        arrays = list(arrays)
        for out, value in zip(sig.outputs, outputs, strict=True):
            if out.aliases is not None:
                k = index[out.aliases]
                if value.sharding != self.in_shardings[k]:  # same layout unless the pass moved it
                    value = jax.device_put(value, self.in_shardings[k])
                arrays[k] = value
        return arrays


def to_torch(array: jax.Array) -> torch.Tensor:
    """A global jax array -> a torch tensor (gathered on one device, copied)."""
    import jax

    single = jax.device_put(array, jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    return torch.from_dlpack(single).clone()


@dataclasses.dataclass(frozen=True)
class SpmdResult:
    outputs: list[torch.Tensor]  # the last step's global outputs, in signature order
    losses: list[torch.Tensor]  # each step's global loss (training steps; empty otherwise)
    state: dict[str, torch.Tensor]  # weight key -> final global value (training steps)


def spmd_function(
    program: Program,
    platform: str = "xla",
    devices: Sequence[Any] | None = None,
    rules: Mapping[Any, Callable[..., Any]] | None = None,
) -> _SpmdFunction:
    """The per-rank program traced, lowered (with `platform`'s rules: "xla", or "neuron" for the
    lowering the neuron target writes) and compiled over its mesh of `devices` (default: the XLA
    CPU devices). `rules`: a backend's rules for graph targets outside the opset, ahead of the
    table (`xla.lowering.jax_function`; the neuron backend's native MX GEMMs); None for xla."""
    return _SpmdFunction(program, platform, devices, rules)


def run_spmd(program: Program, global_inputs: Sequence[torch.Tensor], steps: int = 1) -> SpmdResult:
    """Run the per-rank `program` on mesh.size XLA devices, `steps` times.

    `global_inputs`: the GLOBAL value of every signature input, in signature order (state, then
    the batch, as `portable.runtime.flatten_inputs` orders them). Inputs are sharded onto the
    devices once; for a training step the updated state stays on the devices from step to step
    (donated, aliasing its input) and the same batch is fed every step. Returns the global
    outputs of the last step, each step's loss and the final global state."""
    fn = spmd_function(program)
    sig, layout = program.signature, fn.layout
    _check_global(program, layout, global_inputs)
    if steps > 1 and program.kind is not ProgramKind.TRAINING_STEP:
        raise BackendError(
            f"{program.name} is a {program.kind.value} program: steps={steps} threads training "
            "state",
            fix="run inference programs with steps=1",
        )
    arrays = fn.put(global_inputs)
    losses, outputs = [], []
    for _ in range(steps):
        outputs = fn(arrays)
        for spec, value in zip(sig.outputs, outputs, strict=True):
            if spec.kind is OutputKind.LOSS:
                losses.append(value)
        if program.kind is ProgramKind.TRAINING_STEP:
            arrays = fn.thread(arrays, outputs)
    result = [to_torch(o) for o in outputs]
    state = {
        spec.key: value
        for spec, value in zip(sig.outputs, result, strict=True)
        if spec.kind in (OutputKind.UPDATED_PARAMETER, OutputKind.UPDATED_STATE)
    }
    return SpmdResult(result, [to_torch(loss) for loss in losses], state)


def _check_global(program: Program, layout: SpmdLayout, values: Sequence[torch.Tensor]) -> None:
    inputs = program.signature.inputs
    if len(values) != len(inputs):
        raise InputError(
            f"{program.name} has {len(inputs)} signature inputs, got {len(values)} values",
            fix="pass the global value of every signature input (state, then the batch)",
        )
    for spec, t, value in zip(inputs, layout.inputs, values, strict=True):
        _check_signature(
            program.name, spec.name, TensorSpec(t.global_shape, spec.spec.dtype), value
        )


class SpmdExecutable(Executable):
    """An Executable of a per-rank program over GLOBAL values (see the module docstring)."""

    def __init__(self, program: Program, backend: str, fn: _SpmdFunction | None = None) -> None:
        fn = fn if fn is not None else spmd_function(program)
        super().__init__(program, lambda flat: _run_once(fn, flat), backend)
        self.layout = fn.layout

    def _flatten(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        sig = self.program.signature
        users = sig.user_inputs
        if len(inputs) != len(users):
            names = ", ".join(
                f"{u.name}: {list(self.layout.input(u.name).global_shape)}" for u in users
            )
            raise InputError(
                f"{self.program.name} takes {len(users)} global input(s), got {len(inputs)}",
                fix=f"call it with ({names})",
            )
        it = iter(inputs)
        flat = [next(it) if spec in users else self.state[spec.key] for spec in sig.inputs]
        _check_global(self.program, self.layout, flat)
        return flat


def _run_once(fn: _SpmdFunction, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [to_torch(o) for o in fn(fn.put(flat))]
