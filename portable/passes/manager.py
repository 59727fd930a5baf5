"""`PassManager`: run passes in order, verify between them, keep the history.

Contract: `run(program)` returns a new Program (the input is never mutated) whose
`metadata["passes"]` is the input's list plus the spec of each pass applied, and one PassReport
per pass. Any failure inside a pass, including invalid IR in its output when `verify_each` is on,
becomes a `PassError` naming that pass and the passes applied before it (`history`), with the
original exception as `__cause__`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from portable.errors import PassError, PortableError, VerifyError
from portable.ir.program import Program
from portable.verify import verify

from .base import Pass, PassReport, PassResult

__all__ = ["PassManager"]


@dataclasses.dataclass(frozen=True)
class PassManager:
    """`verify_each`: run `portable.verify` after every pass and check that the pass left its
    input unchanged (tests always set it; it costs one verification and two prints per pass)."""

    passes: tuple[Pass, ...]
    verify_each: bool = False

    def __init__(self, passes: Sequence[Pass], verify_each: bool = False) -> None:
        object.__setattr__(self, "passes", tuple(passes))
        object.__setattr__(self, "verify_each", verify_each)

    def run(self, program: Program) -> tuple[Program, list[PassReport]]:
        history = list(program.metadata.get("passes", []))
        reports = []
        for p in self.passes:
            result = self._run_one(p, program, tuple(history))
            history.append(p.spec())
            # a new Program object even when the pass returned its input: metadata is not shared
            program = dataclasses.replace(
                result.program, metadata={**result.program.metadata, "passes": list(history)}
            )
            reports.append(result.report)
        return program, reports

    def _run_one(self, p: Pass, program: Program, history: tuple[str, ...]) -> PassResult:
        before = program.text() if self.verify_each else None
        try:
            result = p.apply(program)
            if not isinstance(result, PassResult):
                raise TypeError(f"apply() returned {type(result).__name__}, not PassResult")
            if self.verify_each:
                verify(result.program)
                if program.text() != before:
                    raise RuntimeError("it mutated its input program (passes must rewrite a copy)")
        except VerifyError as exc:
            raise PassError(
                f"pass `{p.spec()}` left invalid IR: {exc.what}",
                pass_name=p.name,
                history=history,
                op=exc.op,
                module=exc.module,
                source=exc.source,
                fix=exc.fix,
            ) from exc
        except PortableError as exc:
            raise PassError(
                f"pass `{p.spec()}` failed: {exc.what}",
                pass_name=p.name,
                history=history,
                fix=exc.fix,
            ) from exc
        except Exception as exc:
            raise PassError(
                f"pass `{p.spec()}` failed: {type(exc).__name__}: {exc}",
                pass_name=p.name,
                history=history,
            ) from exc
        return result
