"""Running a program for a parity check: the quantities compared, and the reference's allowance.

Quantities are named `output <name>` and `input <name>` (inference; the latter for the inputs a
program writes into), `loss step <i>` and `state <key>` (training steps: the state after the last
step, parameters and optimizer state). `reference_run` also
measures the rounding allowance of every quantity (`tolerance.py`): the reference runs a second
time from rounding-perturbed inputs, step for step beside the first run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import api
from ..ir.program import Program, ProgramKind
from ..ir.signature import OutputKind
from ..optim import Optimizer
from ..recipe import recipe_of
from ..runtime import Executable
from .tolerance import SPREAD_FACTOR, OptimizerNoise, perturbed, spread_allowance

__all__ = ["Reference", "backend_run", "executable", "reference_run"]

PERTURBATION_SEED = 0


@dataclasses.dataclass(frozen=True)
class Reference:
    """The reference's quantities, the allowance of each (missing: none), and one line saying
    what the allowance was measured from (for the report)."""

    values: dict[str, torch.Tensor]
    allowance: dict[str, torch.Tensor]
    description: str
    deltas: tuple[float, ...] = ()  # the gradient noise of each training step


def backend_run(
    exe: Executable,
    inputs: Sequence[torch.Tensor],
    steps: int,
    state: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The quantities of `exe`'s program run from `state` (default: its weights); `steps`
    steps for a training step."""
    state = dict(exe.state if state is None else state)
    if exe.kind is ProgramKind.INFERENCE:
        exe.state = state
        inputs = [x.clone() for x in inputs]  # a program may write into its inputs
        return {**_outputs(exe.program, exe(*inputs)), **_written(exe.program, inputs)}
    run = _Trajectory(state)
    for _ in range(steps):
        run.step(exe, inputs)
    return run.quantities()


def reference_run(
    exe: Executable,
    inputs: Sequence[torch.Tensor],
    steps: int,
    state: dict[str, torch.Tensor] | None = None,
) -> Reference:
    """The reference's quantities from `state` (default: its weights) and their rounding
    allowance (module docstring)."""
    program = exe.program
    generator = torch.Generator().manual_seed(PERTURBATION_SEED)
    state = dict(exe.state if state is None else state)
    recipe = recipe_of(program.metadata)
    compute = recipe.precision.compute_dtype
    other_state = dict(zip(state, perturbed(list(state.values()), generator, compute), strict=True))
    other_inputs = perturbed(list(inputs), generator, compute)
    if program.kind is ProgramKind.INFERENCE:
        want = backend_run(exe, inputs, 1, state)
        other = backend_run(exe, other_inputs, 1, other_state)
        return Reference(want, spread_allowance(want, other), _SPREAD)
    optimizer = Optimizer.from_dict(program.metadata["optimizer"])
    noise = OptimizerNoise(optimizer, _trained(program), recipe)
    mine, other_run = _Trajectory(state), _Trajectory(other_state)
    for _ in range(steps):
        before, other_before = mine.state, other_run.state
        mine.step(exe, inputs)
        other_run.step(exe, other_inputs)
        noise.add_step(before, mine.state, other_before, other_run.state)
    want = mine.quantities()
    allowance = spread_allowance(want, other_run.quantities())
    for key, value in noise.allowance.items():
        allowance[key] = allowance.get(key, 0) + value
    deltas = ", ".join(f"{d:.1e}" for d in noise.deltas)
    description = f"{_SPREAD}; gradient noise per step {deltas}"
    return Reference(want, allowance, description, tuple(noise.deltas))


def executable(program: Program, backend: str) -> Executable:
    """`program` compiled for `backend` (BackendError where it cannot run)."""
    return api.compile(program, backend=backend)


_SPREAD = f"{SPREAD_FACTOR:g} x the reference's spread under rounding-level input perturbation"


@dataclasses.dataclass
class _Trajectory:
    """One run of training steps: its current state and every step's loss. Runs may share an
    executable: the state is set before each step."""

    state: dict[str, torch.Tensor]
    losses: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def step(self, exe: Executable, inputs: Sequence[torch.Tensor]) -> None:
        exe.state = self.state
        result = exe(*inputs)
        self.state = dict(result.state)
        self.losses.append(result.loss)

    def quantities(self) -> dict[str, torch.Tensor]:
        losses = {f"loss step {i}": loss for i, loss in enumerate(self.losses, start=1)}
        return {**losses, **{f"state {k}": v for k, v in self.state.items()}}


def _outputs(
    program: Program, result: torch.Tensor | tuple[torch.Tensor, ...]
) -> dict[str, torch.Tensor]:
    outs = result if isinstance(result, tuple) else (result,)
    names = [o.name for o in program.signature.outputs if o.kind is OutputKind.OUTPUT]
    return {f"output {n}": t for n, t in zip(names, outs, strict=True)}


def _written(program: Program, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """`input <name>` after the run, for each user input the program writes into."""
    sig = program.signature
    written = {o.aliases for o in sig.outputs if o.kind is OutputKind.UPDATED_INPUT}
    pairs = zip(sig.user_inputs, inputs, strict=True)
    return {f"input {i.name}": x for i, x in pairs if i.name in written}


def _trained(program: Program) -> list[str]:
    """State keys of the parameters the optimizer updates."""
    outputs = program.signature.outputs
    return [o.key for o in outputs if o.kind is OutputKind.UPDATED_PARAMETER]
