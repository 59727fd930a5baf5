"""Cross-backend parity: run one program on several backends and compare against `cpu`.

Inference programs compare every output. Training steps run `steps` optimizer steps on every
backend from the same initial state; each step is compared with the reference's step from the
backend's own state before it (`stepwise.py`): its loss and every updated parameter and
optimizer-state tensor. The tolerance policy is `tolerance.py`'s; MX-quantized programs are
compared under each backend's own quantization decisions (`mx_parity.py`). The `eager` row
compares the reference's whole run with the model run by eager PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..backends import Target, get_backend
from ..capture import capture, capture_spec, spec_of
from ..capture.decorator import Inputs
from ..errors import BackendError, CaptureError, InputError
from ..ir.program import Program, ProgramKind
from ..runtime import Executable
from .compare import ParityRow, compare
from .eager import eager_results
from .mx_parity import FedReference, is_quantized, observed
from .report import ParityReport
from .runs import executable, reference_run
from .stepwise import StepReference, stepwise_rows
from .tolerance import ATOL, RTOL

__all__ = ["ParityReport", "ParityRow", "assert_parity", "check_parity", "compare"]

LossFn = Callable[..., torch.Tensor]


def _as_program(
    model_or_program: object, inputs: Sequence[torch.Tensor] | None
) -> tuple[Program, Inputs, torch.nn.Module | None]:
    """The program, its inputs, and the eager model to compare with (when there is one)."""
    if isinstance(model_or_program, Program):
        return model_or_program, _given(inputs, model_or_program), None
    spec = spec_of(model_or_program)
    if spec is not None:
        model = spec.build()
        program = capture_spec(spec, model=model)
        return program, tuple(inputs) if inputs is not None else spec.inputs(), model
    if isinstance(model_or_program, torch.nn.Module):
        given = _given(inputs, model_or_program)
        return capture(model_or_program, given), given, model_or_program
    raise CaptureError(
        f"assert_parity takes a Program, an nn.Module or a @portable model, got {type(model_or_program).__name__}",
        fix="capture it first with portable.capture(...)",
    )


def _given(inputs: Sequence[torch.Tensor] | None, of: object) -> Inputs:
    if inputs is None:
        raise InputError(
            f"parity needs the inputs of a {type(of).__name__}",
            fix="pass inputs=(...); only a @portable model has example inputs of its own",
        )
    return tuple(inputs)


def check_parity(
    model_or_program: object,
    inputs: Sequence[torch.Tensor] | None = None,
    *,
    backends: Sequence[str],
    rtol: float = RTOL,
    atol: float = ATOL,
    steps: int = 1,
    reference: str = "cpu",
    skip_unavailable: bool = False,
    eager_model: torch.nn.Module | None = None,
    loss_fn: LossFn | None = None,
) -> ParityReport:
    """Compare each backend against `reference` under the tolerance policy (`tolerance.py`):
    elementwise within atol + rtol * |want| + the rounding allowance the reference measures on
    itself; an MX-quantized program step by step under each backend's own quantization
    decisions (`mx_parity.py`). Backends that cannot run on this machine raise BackendError, or
    are listed in `report.skipped` with `skip_unavailable=True`.

    With `eager_model` (and `loss_fn` for a training step) the reference itself is also compared
    with eager PyTorch, as the row `eager`."""
    _check_tolerances(rtol, atol, steps)
    program, inputs, model = _as_program(model_or_program, inputs)
    eager_model = eager_model if eager_model is not None else model
    steps = steps if program.kind is ProgramKind.TRAINING_STEP else 1
    targets = [b for b in backends if b != reference] or [reference]  # alone: determinism
    runnable, skipped = _runnable(targets, skip_unavailable)  # before anything runs
    rows: list[ParityRow] = []
    allowance: list[str] = []
    if eager_model is not None:
        rows, how = _eager_rows(program, eager_model, loss_fn, inputs, steps, reference, rtol, atol)
        allowance.append(f"eager: {how}")
    compile_pair = _pairs(program, reference)
    for backend in runnable:
        found, how = stepwise_rows(backend, *compile_pair(backend), inputs, steps, rtol, atol)
        rows += found
        allowance.append(how)
    return ParityReport(
        program.name,
        program.kind.value,
        reference,
        rtol,
        atol,
        steps,
        tuple(rows),
        tuple(skipped),
        "; ".join(dict.fromkeys(allowance)),
    )


def _check_tolerances(rtol: float, atol: float, steps: int) -> None:
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise InputError(
                f"parity tolerance {name}={value!r} must be a finite number >= 0",
                fix=f"use e.g. {name}={RTOL if name == 'rtol' else ATOL:g} (the default)",
            )
    if not isinstance(steps, int) or steps < 1:
        raise InputError(f"parity steps={steps!r} must be an integer >= 1", fix="use steps=3")


def _runnable(
    backends: Sequence[str], skip_unavailable: bool
) -> tuple[list[str], list[tuple[str, str]]]:
    """The backends that run here, and (backend, why) for the others (BackendError unless
    `skip_unavailable`)."""
    runnable: list[str] = []
    skipped: list[tuple[str, str]] = []
    for backend in backends:
        ok, why = get_backend(Target.parse(backend).backend).can_execute_here()
        if ok:
            runnable.append(backend)
        elif skip_unavailable:
            skipped.append((backend, why))
        else:
            raise BackendError(
                f"backend {backend} cannot run here: {why}",
                fix="drop it from backends=[...] or run on a machine that has it",
            )
    return runnable, skipped


def _pairs(program: Program, reference: str) -> Callable[[str], tuple[Executable, StepReference]]:
    """backend -> (the program compiled for it, the reference its steps are compared with): for
    an MX-quantized program, the observed program and the cpu reference fed its codes."""
    if not is_quantized(program):
        ref = StepReference(executable(program, reference))
        return lambda backend: (executable(program, backend), ref)
    if reference != "cpu":
        raise BackendError(
            f"an MX-quantized program is compared with the cpu reference fed each backend's "
            f"codes; reference={reference!r} cannot be fed",
            fix='use reference="cpu" (the default)',
        )
    seen = observed(program)
    return lambda backend: (executable(seen, backend), FedReference(seen))


def _eager_rows(
    program: Program,
    model: torch.nn.Module,
    loss_fn: LossFn | None,
    inputs: Sequence[torch.Tensor],
    steps: int,
    reference: str,
    rtol: float,
    atol: float,
) -> tuple[list[ParityRow], str]:
    """The reference's run of all `steps` against the model run by eager PyTorch (a
    `torch.optim` loop for a training step), within the reference's allowance over the run;
    and what that allowance was measured from."""
    ref = reference_run(executable(program, reference), inputs, steps)
    eager = eager_results(program, model, inputs, loss_fn=loss_fn, steps=steps)
    rows = [
        compare("eager", k, eager[k], want, rtol, atol, ref.allowance.get(k))
        for k, want in ref.values.items()
        if k in eager
    ]
    return rows, ref.description


def assert_parity(
    model_or_program: object,
    inputs: Sequence[torch.Tensor] | None = None,
    *,
    backends: Sequence[str],
    rtol: float = RTOL,
    atol: float = ATOL,
    steps: int = 1,
    reference: str = "cpu",
    eager_model: torch.nn.Module | None = None,
    loss_fn: LossFn | None = None,
) -> ParityReport:
    """check_parity, raising AssertionError with the readable report on any mismatch."""
    report = check_parity(
        model_or_program,
        inputs,
        backends=backends,
        rtol=rtol,
        atol=atol,
        steps=steps,
        reference=reference,
        eager_model=eager_model,
        loss_fn=loss_fn,
    )
    if not report.ok:
        raise AssertionError(report.format())
    return report
