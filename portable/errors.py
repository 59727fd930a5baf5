"""The one error hierarchy of `portable`.

Every user-facing failure is a `PortableError`. Each carries what went wrong, where (op, module
path, user source line when known) and the fix, and renders them in a fixed order so tests and
users can rely on the message shape:

    CaptureError: data-dependent control flow in `model.blocks.0` (aten.nonzero)
      at examples/moe.py:41
      fix: ...
"""

from __future__ import annotations

__all__ = [
    "AbstractProgramError",
    "ArchiveError",
    "BackendError",
    "CaptureError",
    "CheckpointError",
    "DataError",
    "InputError",
    "JobError",
    "LoweringError",
    "PassError",
    "PlanError",
    "PlannerError",
    "PortableError",
    "RegistryError",
    "ResourceLimitError",
    "VerifyError",
]


class PortableError(Exception):
    """Base of all `portable` errors.

    `what` is one sentence; `op`, `module`, `source` locate it; `fix` says what to do.
    """

    kind = "PortableError"

    def __init__(
        self,
        what: str,
        *,
        op: str | None = None,
        module: str | None = None,
        source: str | None = None,
        fix: str | None = None,
        details: str | None = None,
    ) -> None:
        self.what = what
        self.op = op
        self.module = module
        self.source = source
        self.fix = fix
        self.details = details
        super().__init__(self._render())

    def _render(self) -> str:
        head = self.what
        where = []
        if self.op:
            where.append(f"op `{self.op}`")
        if self.module:
            where.append(f"module `{self.module}`")
        if where:
            head += f" [{', '.join(where)}]"
        lines = [head]
        if self.source:
            lines.append(f"  at {self.source}")
        if self.details:
            lines.extend("  " + line for line in self.details.splitlines())
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        return "\n".join(lines)


class CaptureError(PortableError):
    """The model could not be captured into the portable IR."""


class VerifyError(PortableError):
    """A graph violates the opset or the IR invariants."""


class ArchiveError(PortableError):
    """A saved program is missing, truncated, corrupted, tampered with or too new."""


class RegistryError(PortableError):
    """Unknown or duplicate backend / pass name, or a broken plug-in."""


class BackendError(PortableError):
    """A backend cannot lower, compile or run a program here."""


class LoweringError(BackendError):
    """An op has no lowering rule for a backend."""

    def __init__(self, what: str, *, backend: str, **kw: str | None) -> None:
        self.backend = backend
        super().__init__(what, **kw)


class AbstractProgramError(PortableError):
    """A program captured without weight values (from a `meta`-device model) was asked for
    something that needs them: running it, parity, saving its weights."""


class InputError(PortableError):
    """Run-time inputs do not match the program's signature."""


class DataError(InputError):
    """A training job's data (a token file, a saved dataset, a tokenizer) is missing, short,
    of the wrong dtype, or holds token ids the model cannot take."""


class CheckpointError(PortableError):
    """A checkpoint is missing, truncated, corrupted, from another program, cannot be held by
    the plan it is loaded into, or could not be written (the previous complete one is intact)."""


class JobError(PortableError):
    """A training job cannot start, or stopped: a bad job configuration, a health check that
    fired (non-finite loss, a loss spike), or a drill whose job did not recover."""


class ResourceLimitError(PortableError):
    """Portable would allocate more than a limit of `portable.limits` on behalf of a declared
    shape (an archive's input, a program's intermediate): refused before allocating."""


class PlanError(PortableError):
    """A parallelism plan is inconsistent with the mesh or the program."""


class PlannerError(PortableError):
    """A planner query cannot be answered: an unknown system or number format, a model or
    parallelism configuration that does not fit the devices, a program without costs."""


class PassError(PortableError):
    """A pass failed or left invalid IR; `history` lists the passes applied before it."""

    def __init__(
        self, what: str, *, pass_name: str, history: tuple[str, ...] = (), **kw: str | None
    ) -> None:
        self.pass_name = pass_name
        self.history = tuple(history)
        if history:
            applied = "after passes: " + ", ".join(history)
            kw["details"] = f"{kw['details']}\n{applied}" if kw.get("details") else applied
        super().__init__(what, **kw)
