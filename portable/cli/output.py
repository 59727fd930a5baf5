"""Atomic output directories.

`staging(out, force=...)` yields an empty temporary directory beside `out`; when the block
finishes, the directory is renamed into place, and when it raises, it is deleted, so `out` is
either the complete new output or left exactly as it was.

What may be replaced: nothing (`out` absent), an empty directory, or, with `force`, an earlier
`portable lower` output: a directory whose manifest carries our format marker and that holds no
file the manifest does not list. Anything else is foreign and is never touched
(OutputConflictError, exit 5).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .exit_codes import OutputConflictError
from .manifest import listed_files, read_manifest

__all__ = ["check_destination", "staging"]


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
    """Yield a temporary directory that becomes `out` when the block succeeds."""
    out = Path(os.path.abspath(out))
    check_destination(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the output gets normal permissions
    try:
        yield tmp
        _commit(tmp, out, force=force)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _commit(tmp: Path, out: Path, *, force: bool) -> None:
    check_destination(out, force=force)  # again: `out` may have changed while we worked
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old)  # `old` is an empty directory, so this rename is allowed
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _sample(paths: set[str], limit: int = 5) -> str:
    shown = sorted(paths)[:limit]
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(shown) + more
