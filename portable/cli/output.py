"""Atomic output directories.

`staging(out, force=...)` yields an empty temporary directory beside `out`; when the block
finishes, the directory is renamed into place, and when it raises, it is deleted, so `out` is
either the complete new output or left exactly as it was: a swap interrupted by an exception of
any kind puts the previous output back, signals wait until the swap is done (interrupts.py), and
what a killed run (kill -9, a crash) left beside `out` is cleaned up, or the previous output put
back, by the next run into `out` (`recover_stale`; a run's lock file tells live runs from dead).

What may be replaced: nothing (`out` absent), an empty directory, or, with `force`, an earlier
`portable lower` output: a directory whose manifest carries our format marker and that holds no
file the manifest does not list. Anything else is foreign and is never touched
(OutputConflictError, exit 5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from .. import atomic_dir
from ..atomic_dir import recover_stale
from .exit_codes import OutputConflictError
from .interrupts import abandon_on_stop, deferred
from .manifest import listed_files, read_manifest

__all__ = ["check_destination", "recover_stale", "staging"]


def check_destination(out: Path, *, force: bool) -> None:
    """Raise OutputConflictError unless `out` may be (re)placed; touches nothing."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise OutputConflictError(
            f"{out} exists and is not a directory portable wrote",
            fix="choose another --out; portable never replaces foreign files",
        )
    present = {p.relative_to(out).as_posix() for p in out.rglob("*") if not p.is_dir()}
    if not present:
        return
    manifest = read_manifest(out)
    if manifest is None:
        raise OutputConflictError(
            f"{out} exists and holds files portable did not write (no portable manifest.json): "
            + _sample(present),
            fix="choose another --out or move that directory away; portable never replaces foreign content",
        )
    foreign = present - listed_files(manifest)
    if foreign:
        raise OutputConflictError(
            f"{out} is a portable output but also holds files its manifest does not list: "
            + _sample(foreign),
            fix="move those files away, or choose another --out",
        )
    if not force:
        name = manifest.get("program", {}).get("name", "?")
        raise OutputConflictError(
            f"{out} holds an earlier portable output (program {name})",
            fix="pass --force to replace it, or choose another --out",
        )


@contextlib.contextmanager
def staging(out: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` when the block succeeds (atomic_dir):
    `out` is checked with `check_destination` before and at the swap, signals wait until the
    swap is done, and a process ended at once removes its staging directory.

    Leftovers of runs into the same `out` that were killed (kill -9, a crash) are cleaned first:
    see `portable.atomic_dir.recover_stale`."""
    with atomic_dir.staging(
        out,
        check=lambda dest: check_destination(dest, force=force),
        critical=deferred,
        on_stop=abandon_on_stop,
    ) as tmp:
        yield tmp


def _sample(paths: set[str], limit: int = 5) -> str:
    shown = sorted(paths)[:limit]
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(shown) + more
