"""Cross-backend parity: run one program on several backends and compare against `cpu`.

Inference programs compare every output. Training steps run `steps` optimizer steps on every
backend from the same initial state and compare the loss of each step and, after the last step,
every updated parameter and optimizer-state tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import BackendError, CaptureError
from ..ir.program import Program, ProgramKind
from .compare import ParityRow, compare

__all__ = ["ParityReport", "ParityRow", "assert_parity", "check_parity", "compare"]


@dataclasses.dataclass(frozen=True)
class ParityReport:
    program: str
    kind: str
    reference: str
    rtol: float
    atol: float
    steps: int
    rows: tuple[ParityRow, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (backend, why it did not run)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def mismatches(self) -> list[ParityRow]:
        return [r for r in self.rows if not r.ok]

    def summary(self) -> list[tuple[str, int, float, float, bool]]:
        """Per backend: (backend, quantities compared, max abs err, max rel err, ok)."""
        out = []
        for backend in dict.fromkeys(r.backend for r in self.rows):
            rows = [r for r in self.rows if r.backend == backend]
            out.append(
                (
                    backend,
                    len(rows),
                    max(r.max_abs for r in rows),
                    max(r.max_rel for r in rows),
                    all(r.ok for r in rows),
                )
            )
        return out

    def format(self, *, all_rows: bool = False) -> str:
        head = (
            f"parity of {self.program} ({self.kind}, {self.steps} step(s)) vs {self.reference}, "
            f"rtol={self.rtol:g} atol={self.atol:g}"
        )
        lines = [head, f"  {'backend':<14}{'compared':>9}{'max abs':>12}{'max rel':>12}  result"]
        for backend, n, mabs, mrel, ok in self.summary():
            lines.append(
                f"  {backend:<14}{n:>9}{mabs:>12.3e}{mrel:>12.3e}  {'ok' if ok else 'MISMATCH'}"
            )
        if any(r.backend == "eager" for r in self.rows):
            lines.append(
                f"  (eager: the model run by eager PyTorch, compared with {self.reference})"
            )
        for backend, why in self.skipped:
            lines.append(f"  {backend:<14}{'-':>9}{'-':>12}{'-':>12}  not run: {why}")
        shown = self.rows if all_rows else self.mismatches()
        for r in shown:
            where = (
                f" first mismatch at {list(r.first_mismatch)}"
                if r.first_mismatch is not None
                else ""
            )
            lines.append(
                f"    {r.backend} {r.quantity}: max abs {r.max_abs:.3e}, max rel {r.max_rel:.3e}"
                f"{where}{' ' + r.note if r.note else ''}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "kind": self.kind,
            "reference": self.reference,
            "rtol": self.rtol,
            "atol": self.atol,
            "steps": self.steps,
            "ok": self.ok,
            "rows": [r.to_json() for r in self.rows],
            "skipped": [{"backend": b, "why": w} for b, w in self.skipped],
        }


def _as_program(model_or_program, inputs) -> tuple[Program, tuple, torch.nn.Module | None]:
    """The program, its inputs, and the eager model to compare with (when there is one)."""
    if isinstance(model_or_program, Program):
        return model_or_program, tuple(inputs), None
    from ..capture import capture, capture_spec, spec_of

    spec = spec_of(model_or_program)
    if spec is not None:
        model = spec.build()
        program = capture_spec(spec, model=model)
        return program, tuple(inputs) if inputs is not None else spec.inputs(), model
    if isinstance(model_or_program, torch.nn.Module):
        return capture(model_or_program, tuple(inputs)), tuple(inputs), model_or_program
    raise CaptureError(
        f"assert_parity takes a Program, an nn.Module or a @portable model, got {type(model_or_program).__name__}",
        fix="capture it first with portable.capture(...)",
    )


def _run(program: Program, backend: str, inputs: Sequence[torch.Tensor], steps: int):
    from ..api import compile

    exe = compile(program, backend=backend)
    if program.kind is ProgramKind.INFERENCE:
        out = exe(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        names = [o.name for o in program.signature.outputs]
        return {f"output {n}": t for n, t in zip(names, outs, strict=True)}
    results = {}
    for step in range(steps):
        result = exe(*inputs)
        results[f"loss step {step + 1}"] = result.loss
    for key, value in result.state.items():
        results[f"state {key}"] = value
    return results


def check_parity(
    model_or_program,
    inputs: Sequence[torch.Tensor] | None = None,
    *,
    backends: Sequence[str],
    rtol: float = 1e-5,
    atol: float = 1e-6,
    steps: int = 1,
    reference: str = "cpu",
    skip_unavailable: bool = False,
    eager_model: torch.nn.Module | None = None,
    loss_fn=None,
) -> ParityReport:
    """Compare each backend against `reference`. Backends that cannot run on this machine raise
    BackendError, or are listed in `report.skipped` with `skip_unavailable=True`.

    With `eager_model` (and `loss_fn` for a training step) the reference itself is also compared
    with eager PyTorch, as the row `eager`."""
    from ..backends import Target, get_backend

    program, inputs, model = _as_program(model_or_program, inputs)
    eager_model = eager_model if eager_model is not None else model
    want = _run(program, reference, inputs, steps)
    rows, skipped = [], []
    if eager_model is not None:
        from .eager import eager_results

        eager = eager_results(program, eager_model, inputs, loss_fn=loss_fn, steps=steps)
        rows += [compare("eager", k, want[k], eager[k], rtol, atol) for k in want if k in eager]
    for backend in backends:
        if backend == reference:
            continue
        ok, why = get_backend(Target.parse(backend).backend).can_execute_here()
        if not ok:
            if not skip_unavailable:
                raise BackendError(
                    f"backend {backend} cannot run here: {why}",
                    fix="drop it from backends=[...] or run on a machine that has it",
                )
            skipped.append((backend, why))
            continue
        got = _run(program, backend, inputs, steps)
        rows += [compare(backend, k, got[k], want[k], rtol, atol) for k in want]
    if list(backends) == [reference]:
        # only the reference was asked for: compare it with itself (determinism)
        got = _run(program, reference, inputs, steps)
        rows += [compare(reference, k, got[k], want[k], rtol, atol) for k in want]
    return ParityReport(
        program.name,
        program.kind.value,
        reference,
        rtol,
        atol,
        steps if program.kind is ProgramKind.TRAINING_STEP else 1,
        tuple(rows),
        tuple(skipped),
    )


def assert_parity(
    model_or_program,
    inputs=None,
    *,
    backends: Sequence[str],
    rtol: float = 1e-5,
    atol: float = 1e-6,
    steps: int = 1,
    reference: str = "cpu",
    eager_model: torch.nn.Module | None = None,
    loss_fn=None,
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
