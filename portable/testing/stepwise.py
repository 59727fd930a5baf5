"""Step by step parity: each step of a backend against the reference's step from the same state.

For step t the backend runs from its own state after step t-1, and the reference runs that same
step from that same state (and, for its allowance, from a rounding-perturbed copy: `runs.py`,
`tolerance.py`). The loss, every output and every updated state tensor of the step are compared.
So rounding does not compound over steps: a training trajectory amplifies it (AdamW moves an
element whose gradient is rounding noise by up to lr in a direction rounding picks, which moves
the next step's gradients beyond rounding), while one step from one state is determined by the
program up to the allowance. An inference program is one step from the weights. A quantity's
row is the worst of its steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ir.program import ProgramKind
from ..runtime import Executable
from .compare import ParityRow, compare
from .gauge import align, gauge_outputs
from .runs import Reference, backend_run, reference_run
from .tolerance import SPREAD_FACTOR

__all__ = ["StepReference", "stepwise_rows"]


class StepReference:
    """The reference a backend's steps are compared with: `executable` run from the backend's
    state. Subclasses feed it what the backend decided (`mx_parity.FedReference`)."""

    def __init__(self, executable: Executable) -> None:
        self.executable = executable

    def prepare(self, got: dict[str, torch.Tensor]) -> None:
        """Called with the backend's results of a step before the reference runs it."""

    def compares(self, key: str) -> bool:
        return True

    def label(self, key: str) -> str:
        return key

    def extra_rows(
        self, backend: str, got: dict[str, torch.Tensor], ref: Reference
    ) -> list[ParityRow]:
        return []


def stepwise_rows(
    backend: str,
    exe: Executable,
    reference: StepReference,
    inputs: Sequence[torch.Tensor],
    steps: int,
    rtol: float,
    atol: float,
) -> tuple[list[ParityRow], str]:
    """The rows of `backend` (its program compiled as `exe`), and what the allowance was
    measured from."""
    training = exe.kind is ProgramKind.TRAINING_STEP
    state = dict(exe.state)
    found: list[tuple[int, ParityRow]] = []
    deltas: list[float] = []
    gauges = gauge_outputs(reference.executable.program)
    for step in range(1, (steps if training else 1) + 1):
        got = backend_run(exe, inputs, 1, state)
        reference.prepare(got)
        ref = reference_run(reference.executable, inputs, 1, state)
        got = align(gauges, got, ref.values)  # singular/eigen vectors up to sign (gauge.py)
        for key, want in ref.values.items():
            if not reference.compares(key):
                continue
            label = f"loss step {step}" if key == "loss step 1" else reference.label(key)
            found.append((step, _row(backend, label, got.get(key), want, rtol, atol, ref, key)))
        found += [(step, row) for row in reference.extra_rows(backend, got, ref)]
        deltas += ref.deltas
        state = {k.removeprefix("state "): v for k, v in got.items() if k.startswith("state ")}
    return _worst(found, steps if training else 1), _description(training, deltas)


def _row(
    backend: str,
    label: str,
    got: torch.Tensor | None,
    want: torch.Tensor,
    rtol: float,
    atol: float,
    ref: Reference,
    key: str,
) -> ParityRow:
    if got is None:
        inf = float("inf")
        return ParityRow(backend, label, inf, inf, None, False, "not produced by the backend")
    return compare(backend, label, got, want, rtol, atol, ref.allowance.get(key))


def _worst(found: list[tuple[int, ParityRow]], steps: int) -> list[ParityRow]:
    """One row per quantity (every step's loss first): the first failing step's, else the step
    with the largest error; max abs / rel over all steps."""
    groups: dict[tuple[str, str], list[tuple[int, ParityRow]]] = {}
    for step, row in found:
        groups.setdefault((row.backend, row.quantity), []).append((step, row))
    merged = []
    for group in groups.values():
        failing = [(s, r) for s, r in group if not r.ok]
        step, pick = failing[0] if failing else max(group, key=lambda sr: sr[1].max_abs)
        where = f"step {step}" if steps > 1 and len(group) > 1 else ""
        note = ": ".join(n for n in (where, pick.note) if n)
        merged.append(
            ParityRow(
                pick.backend,
                pick.quantity,
                max(r.max_abs for _, r in group),
                max(r.max_rel for _, r in group),
                pick.first_mismatch,
                not failing,
                note,
            )
        )
    return sorted(merged, key=lambda r: not r.quantity.startswith("loss step"))  # losses first


def _description(training: bool, deltas: list[float]) -> str:
    text = (
        f"{SPREAD_FACTOR:g} x the spread of the reference's step under rounding-level "
        "perturbation of its inputs"
    )
    if training:
        noise = ", ".join(f"{d:.1e}" for d in deltas)
        text = f"each step from the backend's own state; {text}; gradient noise {noise}"
    return text
