"""The parity report: one row per compared quantity and backend, a per-backend summary, the
readable text `portable lower --parity` prints and the JSON its manifest stores."""

from __future__ import annotations

import dataclasses
from typing import Any

from .compare import ParityRow

__all__ = ["ParityReport"]


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
    allowance: str = ""  # what the reference measured of its own rounding (tolerance.py)

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
        lines = [head] + ([f"  + rounding allowance: {self.allowance}"] if self.allowance else [])
        lines += [f"  {'backend':<14}{'compared':>9}{'max abs':>12}{'max rel':>12}  result"]
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
            "allowance": self.allowance,
            "ok": self.ok,
            "rows": [r.to_json() for r in self.rows],
            "skipped": [{"backend": b, "why": w} for b, w in self.skipped],
        }
