"""`Executable`: what `portable.compile` returns, the same for every backend.

A backend supplies one function over flat tensors (the graph's inputs in signature order -> its
outputs in signature order). The executable owns what is common: checking user inputs against the
signature, holding the program state (weights, optimizer state), threading updated state from one
training step to the next, and shaping results.

- inference: `exe(*inputs)` returns the output tensor, or a tuple when there are several; an
  input the model writes into (an `updated_input` output) gets its new value copied in.
- training step: `exe(*batch)` performs one step and returns `StepResult(loss, state, metrics)`
  (`.lr`, `.grad_norm`, `.loss_scale`); the executable keeps the new state for the next call
  (`exe.state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .errors import InputError
from .ir.program import Program, ProgramKind
from .ir.signature import InputKind, OutputKind, TensorSpec
from .ir.symbolic import SizeExprError, parse_size
from .limits import check_program

__all__ = ["Executable", "StepResult", "bind_symbols", "flatten_inputs", "storage_problem"]

FlatFn = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One training step's loss, the state after it, and its metrics (METRIC outputs by name:
    `lr` always, `grad_norm` with clip_grad_norm, `loss_scale` with float16 compute)."""

    loss: torch.Tensor
    state: dict[str, torch.Tensor]  # weight key (e.g. "fc1.weight", "optimizer.step") -> value
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def lr(self) -> torch.Tensor | None:
        """The learning rate this step used (the optimizer's base group)."""
        return self.metrics.get("lr")

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm before clipping (None without clip_grad_norm)."""
        return self.metrics.get("grad_norm")

    @property
    def loss_scale(self) -> torch.Tensor | None:
        """The loss scale this step used (None without float16 compute)."""
        return self.metrics.get("loss_scale")


class Executable:
    def __init__(self, program: Program, fn: FlatFn, backend: str) -> None:
        program.require_values(f"running on {backend}")
        self.program = program
        self.backend = backend
        self._fn = fn
        sig = program.signature
        self._state_specs = sig.state_inputs
        # weight key -> current value; updated in place of the dict by training steps
        self.state: dict[str, torch.Tensor] = {
            s.key: program.weights[s.key] for s in self._state_specs
        }
        check_program(program)  # static sizes; dynamic ones when a call binds them
        self._checked_bindings: set[tuple[tuple[str, int], ...]] = set()

    @property
    def kind(self) -> ProgramKind:
        return self.program.kind

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """The output tensor (a tuple for several), or a `StepResult` for a training step: the
        program's kind decides at run time, so the static type is `Any` (as `nn.Module`'s)."""
        flat = self._flatten(inputs)
        self._check_allocations(flat)
        outputs = list(self._fn(flat))
        if self.kind is ProgramKind.TRAINING_STEP:
            return self._step(outputs)
        sig = self.program.signature
        self._write_back(inputs, outputs)
        user = [v for s, v in zip(sig.outputs, outputs, strict=True) if s.kind is OutputKind.OUTPUT]
        return user[0] if len(user) == 1 else tuple(user)

    def _write_back(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        """Copy each `updated_input` output into the caller's tensor, as the model's in-place
        write does in eager (e.g. F.batch_norm updating running statistics it was passed)."""
        sig = self.program.signature
        position = {spec.name: i for i, spec in enumerate(sig.user_inputs)}
        with torch.no_grad():
            for spec, value in zip(sig.outputs, outputs, strict=True):
                if spec.kind is OutputKind.UPDATED_INPUT and spec.aliases is not None:
                    inputs[position[spec.aliases]].copy_(value)

    def _step(self, outputs: Sequence[torch.Tensor]) -> StepResult:
        """Keep the updated state for the next call; the result has the LOSS output."""
        loss = None
        new_state = dict(self.state)
        metrics = {}
        for spec, value in zip(self.program.signature.outputs, outputs, strict=True):
            if spec.kind is OutputKind.LOSS:
                loss = value
            elif spec.kind in (OutputKind.UPDATED_PARAMETER, OutputKind.UPDATED_STATE):
                new_state[spec.key] = value
            elif spec.kind is OutputKind.METRIC:
                metrics[spec.name] = value
        if loss is None:  # capture always declares one; a hand-built program may not
            raise InputError(
                f"training step {self.program.name} has no loss output",
                fix="declare the loss among the signature's outputs (OutputKind.LOSS)",
            )
        self.state = new_state
        return StepResult(loss, dict(new_state), metrics)

    def _flatten(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return flatten_inputs(self.program, inputs, self.state)

    def _check_allocations(self, flat: Sequence[torch.Tensor]) -> None:
        """With dynamic dims, what this call's sizes make every node allocate (once per size)."""
        if not self.program.metadata.get("symbolic_dims"):
            return
        bindings = bind_symbols(self.program, flat)
        key = tuple(sorted(bindings.items()))
        if key not in self._checked_bindings:
            check_program(self.program, bindings)
            self._checked_bindings.add(key)


def bind_symbols(program: Program, flat: Sequence[torch.Tensor]) -> dict[str, int]:
    """The value of each declared dynamic dim in this call (InputError when two inputs give
    one dim two sizes: the program would compute with shapes that do not fit together)."""
    bindings: dict[str, int] = {}
    compound = []
    for spec, value in zip(program.signature.inputs, flat, strict=True):
        for d, (want, have) in enumerate(zip(spec.spec.shape, value.shape, strict=True)):
            if not isinstance(want, str):
                continue
            if not want.isidentifier():
                compound.append((spec.name, d, want, int(have)))
            elif bindings.setdefault(want, int(have)) != int(have):
                raise InputError(
                    f"dynamic dim {want} of {program.name} is {bindings[want]} in one input and "
                    f"{int(have)} in `{spec.name}` (dim {d})",
                    fix="give every input the same size along the dims that share a symbol",
                )
    for name, d, want, have in compound:
        try:
            expected = parse_size(want).evaluate(bindings)
        except SizeExprError:
            continue  # a symbol only this dim uses: nothing to compare with
        if expected != have:
            raise InputError(
                f"input `{name}` of {program.name} has dim {d} = {have}, but {want} = {expected}",
                fix="pass sizes that satisfy the program's dynamic dims",
            )
    return bindings


def flatten_inputs(
    program: Program, inputs: Sequence[torch.Tensor], state: Mapping[str, torch.Tensor]
) -> list[torch.Tensor]:
    """The graph's flat inputs in signature order: user inputs from `inputs` (checked against
    the signature: InputError naming the input and the fix), state from `state` by weight key."""
    users = program.signature.user_inputs
    if len(inputs) != len(users):
        names = ", ".join(f"{u.name}: {u.spec}" for u in users)
        raise InputError(
            f"{program.name} takes {len(users)} input(s), got {len(inputs)}",
            fix=f"call it with ({names})",
        )
    it = iter(inputs)
    flat = []
    for spec in program.signature.inputs:
        if spec.kind is InputKind.USER_INPUT:
            value = next(it)
            _check_input(program, spec.name, spec.spec, value)
            flat.append(value)
        else:
            flat.append(state[spec.key])
    return flat


def _check_input(program: Program, name: str, spec: TensorSpec, value: object) -> None:
    symbols = program.metadata.get("symbolic_dims", {})
    if isinstance(value, torch.Tensor):
        for want, have in zip(spec.shape, value.shape, strict=False):
            bounds = symbols.get(want) if isinstance(want, str) else None
            if bounds and not (bounds["min"] <= have <= (bounds["max"] or have)):
                raise InputError(
                    f"input `{name}` of {program.name}: dynamic dim {want} = {have} is outside "
                    f"its declared range [{bounds['min']}, {bounds['max']}]",
                    fix="pass a size within the range, or re-capture with a wider Dim(min=, max=)",
                )
    _check_signature(program.name, name, spec, value)


def storage_problem(value: torch.Tensor) -> str | None:
    """Why a tensor cannot be a program's value ("is a sparse tensor (torch.sparse_coo)", "is
    on the meta device (no data)"), or None: programs hold dense (strided) tensors with data."""
    if value.layout != torch.strided:
        kind = "sparse tensor" if "sparse" in str(value.layout) else "tensor of layout"
        return f"is a {kind} ({value.layout})"
    if value.is_meta:
        return "is on the meta device (no data)"
    return None


def _check_signature(program: str, name: str, spec: TensorSpec, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise InputError(
            f"input `{name}` of {program} must be a tensor, got {type(value).__name__}",
            fix=f"pass a {spec} tensor",
        )
    problem = storage_problem(value)
    if problem is not None:
        raise InputError(
            f"input `{name}` of {program} {problem}",
            fix=f"pass a dense {spec} tensor with data (sparse: x.to_dense())",
        )
    got = TensorSpec.of(value)
    shape_ok = len(got.shape) == len(spec.shape) and all(
        isinstance(want, str) or want == have
        for want, have in zip(spec.shape, got.shape, strict=True)
    )
    if got.dtype != spec.dtype or not shape_ok:
        what = "dtype" if shape_ok else "shape"
        raise InputError(
            f"input `{name}` of {program} has the wrong {what}: expected {spec}, got {got}",
            fix=f"pass a {spec} tensor, or re-capture the program with inputs of this shape/dtype "
            "(or declare the dim dynamic with dynamic_shapes=...)",
        )
