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
import glob
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from .exit_codes import OutputConflictError
from .interrupts import abandon_on_stop, deferred
from .manifest import listed_files, read_manifest

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so no cleanup of other runs' leftovers
    fcntl = None  # type: ignore[assignment]

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
    """Yield a temporary directory that becomes `out` when the block succeeds.

    Leftovers of runs into the same `out` that were killed (kill -9, a crash) are cleaned first:
    see `recover_stale`."""
    out = Path(os.path.abspath(out))
    check_destination(out, force=force)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_stale(out)
    with _Claim(out) as claim, abandon_on_stop(claim.abandon):
        claim.tmp.mkdir(mode=0o777)  # the umask applies: the output gets normal permissions
        try:
            yield claim.tmp
            _commit(claim, out, force=force)
        finally:
            claim.remove_tmp()


def recover_stale(out: Path) -> list[str]:
    """Undo what runs into `out` that died left beside it; return the names removed.

    Each run holds an exclusive lock (flock) on its lock file `.OUT.tmp-TOKEN.lock` while it
    works; the kernel releases it when the process ends, however it ends. A lock we can take
    belongs to a dead run: its `.OUT.tmp-TOKEN/` is deleted, and its `.OUT.old-TOKEN/` (the
    previous output, moved aside by a swap that died half way) is put back as `out` when `out`
    is missing, or deleted. Locked files are live runs' and are never touched. A staging
    directory of ours whose lock file is gone is removed once the process its name carries has
    ended; other directories without a lock file are not ours to judge."""
    removed: list[str] = []
    if fcntl is None:
        return removed
    for lock in sorted(out.parent.glob(f".{glob.escape(out.name)}.tmp-*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live run holds it
            os.close(fd)
            continue
        try:
            removed += _Claim.from_lock(out, lock).recover()
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed + _remove_unlocked(out)


def _remove_unlocked(out: Path) -> list[str]:
    """Our staging directories that lost their lock file (a process ended at once while its main
    thread still wrote) are removed once the process named in them is gone."""
    removed = []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.tmp-(\d+)-[0-9a-f]{{8}}")
    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        match = pattern.fullmatch(path.name)
        if match and path.is_dir() and not Path(f"{path}.lock").exists():
            if not _alive(int(match[1])):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Claim:
    """The lock file, staging directory and set-aside directory of one run into `out`."""

    def __init__(self, out: Path, token: str | None = None) -> None:
        self.out = out
        self.token = token or f"{os.getpid()}-{secrets.token_hex(4)}"
        base = out.parent / f".{out.name}"
        self.tmp = Path(f"{base}.tmp-{self.token}")
        self.old = Path(f"{base}.old-{self.token}")
        self.lock = Path(f"{self.tmp}.lock")
        self._fd: int | None = None

    @classmethod
    def from_lock(cls, out: Path, lock: Path) -> _Claim:
        token = lock.name[len(f".{out.name}.tmp-") : -len(".lock")]
        return cls(out, token)

    def __enter__(self) -> _Claim:
        # locked under a private name, then renamed: a sweeper never sees it unlocked
        hidden = Path(f"{self.lock}.new")
        fd = os.open(hidden, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.rename(hidden, self.lock)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.unlink(missing_ok=True)
        if self._fd is not None:
            os.close(self._fd)

    def remove_tmp(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def abandon(self) -> None:
        """What a process that ends at once removes (interrupts.abandon_on_stop). The main
        thread may still be writing into the staging directory: if anything is left, the lock
        file stays, and the next run into `out` finds it free and removes the rest."""
        self.remove_tmp()
        if self.out.exists():
            shutil.rmtree(self.old, ignore_errors=True)  # the swap was done
        if not self.tmp.exists() and not self.old.exists():
            self.lock.unlink(missing_ok=True)

    def recover(self) -> list[str]:
        """A dead run's leftovers: the staging directory deleted, a set-aside output restored."""
        removed = []
        if self.old.is_dir():
            if not self.out.exists() and not self.out.is_symlink():
                os.rename(self.old, self.out)  # the swap died between its two renames
            else:
                shutil.rmtree(self.old, ignore_errors=True)
                removed.append(self.old.name)
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
            removed.append(self.tmp.name)
        return removed


def _commit(claim: _Claim, out: Path, *, force: bool) -> None:
    """Swap the staging directory into place. Whatever is raised between the two renames (an
    OSError, an interrupt, a bug), the previous output is put back; signals wait for the end."""
    with deferred():
        check_destination(out, force=force)  # again: `out` may have changed while we worked
        moved = out.exists()
        if moved:
            os.rename(out, claim.old)
        try:
            os.rename(claim.tmp, out)
        except BaseException:
            if moved:
                os.rename(claim.old, out)
            raise
    if moved:
        shutil.rmtree(claim.old, ignore_errors=True)


def _sample(paths: set[str], limit: int = 5) -> str:
    shown = sorted(paths)[:limit]
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(shown) + more
