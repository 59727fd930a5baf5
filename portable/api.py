"""Top-level entry points that tie capture, passes and backends together."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .backends import Target, get_backend, registry
from .errors import BackendError
from .ir.program import Program
from .runtime import Executable

if TYPE_CHECKING:
    from .backends import Written


def compile(program: Program, backend: str = "cpu") -> Executable:  # noqa: A001 (mirrors torch.compile)
    """Lower, compile and load `program` on `backend` (`"cpu"`, `"xla"`, `"cuda:sm_90"`, ...).

    Returns a callable `Executable`; raises BackendError when the backend cannot run here and
    AbstractProgramError when the program has no weight values (an abstract capture)."""
    target = Target.parse(backend)
    program.require_values(f"running on {target.backend}")
    impl = get_backend(target.backend)
    impl.require()  # missing optional packages: the pip install is the fix, not another backend
    ok, why = impl.can_execute_here()
    if not ok:
        runnable = [n for n in registry.names() if get_backend(n).can_execute_here()[0]]
        raise BackendError(
            f"backend {target.backend} cannot run on this machine: {why}",
            fix=f"backends that run here: {', '.join(runnable)}; "
            f"`portable lower --target {target}` still writes its artifacts",
        )
    return impl.executable(impl.write(impl.lower(program, target)))


def lower(
    program: Program, target: str, out_dir: str | Path | None = None, options: object | None = None
) -> Written:
    """Lower (and, with `out_dir`, write the artifacts of) `program` for `target`; `options` is
    the backend's options object (`CudaOptions`, `NeuronOptions`), defaults when None.
    `out_dir` is created when missing (after lowering succeeded), and removed again when
    writing fails."""
    t = Target.parse(target)
    impl = get_backend(t.backend, options)
    lowered = impl.lower(program, t)
    if out_dir is None:
        return impl.write(lowered, None)
    out = Path(out_dir)
    created = _missing_top(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return impl.write(lowered, out)
    except BaseException:
        if created is not None:  # nothing half-written: what lower created goes again
            shutil.rmtree(created, ignore_errors=True)
        raise


def _missing_top(path: Path) -> Path | None:
    """The outermost folder of `path` that does not exist yet (None when `path` exists)."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing
