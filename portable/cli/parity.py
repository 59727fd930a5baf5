"""`lower --parity`: compare the lowered targets that run here against the `cpu` reference.

Inputs are the spec's example inputs (inference, one step) or its example batch (training, three
steps, so optimizer state is threaded). A program loaded from an archive has no examples; its
user inputs are then made from the signature under a fixed seed (floats ~ N(0, 1), integers and
bools zero, so indices stay in range).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..backends import Target, get_backend
from ..errors import InputError
from ..ir.program import Program, ProgramKind
from ..limits import check_tensor_bytes
from .load_spec import Source

__all__ = ["ParityOutcome", "run_parity"]

TRAINING_STEPS = 3


@dataclasses.dataclass(frozen=True)
class ParityOutcome:
    ok: bool  # True also when no target could run here (nothing disagreed)
    record: dict[str, Any]  # what the manifest stores under "parity"
    text: str  # the human-readable report


def run_parity(
    program: Program,
    source: Source,
    targets: list[Target],
    *,
    rtol: float | None,
    atol: float | None,
    compare_eager: bool = True,
) -> ParityOutcome:
    """Run `check_parity` for the targets whose backend can execute here; with `compare_eager`
    (passes kept the numerics), also the `cpu` program against the eager model."""
    here, lowered_only = [], []
    for target in targets:
        ok, why = get_backend(target.backend).can_execute_here()
        if ok:
            here.append(str(target))
        else:
            lowered_only.append({"target": str(target), "reason": why})
    training = program.kind is ProgramKind.TRAINING_STEP
    steps = TRAINING_STEPS if training else 1
    record: dict[str, Any] = {"backends": here, "lowered_only": lowered_only, "steps": steps}
    skipped = "".join(f"{t['target']}: lowered only ({t['reason']})\n" for t in lowered_only)
    if not here:
        record.update(ok=None, report=None)
        return ParityOutcome(
            True, record, skipped + "parity: no target can run here; nothing compared\n"
        )
    from ..testing import check_parity
    from ..testing.tolerance import ATOL, RTOL

    eager_model, loss_fn = None, None
    if source.spec is not None and compare_eager:  # the reference vs the eager model itself
        eager_model, loss_fn = source.spec.build(), source.spec.loss_fn
    report = check_parity(
        program,
        _inputs(program, source, training),
        backends=here,
        steps=steps,
        # the one policy of check_parity (portable/testing/tolerance.py); --rtol/--atol override
        rtol=RTOL if rtol is None else rtol,
        atol=ATOL if atol is None else atol,
        eager_model=eager_model,
        loss_fn=loss_fn,
    )
    compared = eager_model is not None
    record.update(ok=bool(report.ok), report=report.to_json(), eager_compared=compared)
    verdict = "ok" if report.ok else "MISMATCH"
    if source.spec is not None and not compare_eager:
        skipped += "eager: not compared (a pass changed the numerics on purpose)\n"
    return ParityOutcome(
        bool(report.ok), record, f"{report.format().rstrip()}\n{skipped}parity: {verdict}\n"
    )


def _inputs(program: Program, source: Source, training: bool) -> tuple[Any, ...]:
    if source.spec is not None:
        return source.spec.batch() if training else source.spec.inputs()
    generator = torch.Generator().manual_seed(0)
    values = []
    for spec in program.signature.user_inputs:
        if not all(isinstance(d, int) for d in spec.spec.shape):
            raise InputError(
                f"--parity cannot make an example for input {spec.name} ({spec.spec}): its shape is symbolic",
                fix="run --parity on the @portable SPEC, whose example inputs are recorded",
            )
        shape = tuple(int(d) for d in spec.spec.shape)
        check_tensor_bytes(shape, spec.spec.dtype, f"the --parity example for input {spec.name}")
        if spec.spec.dtype.is_floating_point:
            values.append(torch.randn(shape, generator=generator).to(spec.spec.dtype))
        else:
            values.append(torch.zeros(shape, dtype=spec.spec.dtype))
    return tuple(values)
