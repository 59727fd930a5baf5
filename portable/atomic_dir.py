"""Directories replaced atomically, and what a killed writer leaves behind.

`staging(out, check=...)` yields an empty temporary directory beside `out`; when the block
finishes it becomes `out` (a previous `out` is moved aside, the new one renamed in, the old one
deleted), and when it raises it is deleted. So `out` is the complete new directory or exactly the
previous one: an exception of any kind between the two renames puts the previous one back, and
what a killed writer (kill -9, a crash, a power loss) left beside `out` is cleaned up, or the
previous `out` put back, by the next writer into `out` (`recover_stale`: a writer's lock file
tells live writers from dead ones). `portable lower` outputs (portable/cli/output.py) and program
archives (portable/archive.py) are written this way.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so no cleanup of other writers' leftovers
    fcntl = None  # type: ignore[assignment]

__all__ = ["Claim", "recover_stale", "staging"]


@contextlib.contextmanager
def staging(
    out: Path,
    *,
    check: Callable[[Path], None] = lambda out: None,
    critical: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    on_stop: Callable[[Callable[[], None]], contextlib.AbstractContextManager] | None = None,
) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` when the block succeeds.

    `check(out)` raises when `out` may not be replaced: it runs first and again at the swap
    (`out` may have changed meanwhile). `critical()` wraps the swap (the CLI defers signals
    there); `on_stop(undo)` registers what to remove if the process is ended at once."""
    out = Path(os.path.abspath(out))
    check(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_stale(out)
    with Claim(out) as claim, (on_stop or _nothing_on_stop)(claim.abandon):
        claim.tmp.mkdir(mode=0o777)  # the umask applies: the result gets normal permissions
        try:
            yield claim.tmp
            with critical():
                check(out)
                claim.swap()
            claim.drop_old()
        finally:
            claim.remove_tmp()


@contextlib.contextmanager
def _nothing_on_stop(undo: Callable[[], None]) -> Iterator[None]:
    yield


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
            removed += Claim.from_lock(out, lock).recover()
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


class Claim:
    """The lock file, staging directory and set-aside directory of one writer into `out`."""

    def __init__(self, out: Path, token: str | None = None) -> None:
        self.out = out
        self.token = token or f"{os.getpid()}-{secrets.token_hex(4)}"
        base = out.parent / f".{out.name}"
        self.tmp = Path(f"{base}.tmp-{self.token}")
        self.old = Path(f"{base}.old-{self.token}")
        self.lock = Path(f"{self.tmp}.lock")
        self._fd: int | None = None
        self.moved = False

    @classmethod
    def from_lock(cls, out: Path, lock: Path) -> Claim:
        token = lock.name[len(f".{out.name}.tmp-") : -len(".lock")]
        return cls(out, token)

    def __enter__(self) -> Claim:
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

    def swap(self) -> None:
        """Rename the staging directory to `out`, the previous `out` moved aside first. Whatever
        is raised between the two renames (an OSError, an interrupt, a bug), the previous `out`
        is put back."""
        self.moved = self.out.exists() or self.out.is_symlink()
        if self.moved:
            os.rename(self.out, self.old)
        try:
            os.rename(self.tmp, self.out)
        except BaseException:
            if self.moved:
                os.rename(self.old, self.out)
            raise

    def drop_old(self) -> None:
        if self.moved:
            shutil.rmtree(self.old, ignore_errors=True)

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
