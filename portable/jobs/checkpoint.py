"""Checkpoints of a training run: `RUN/checkpoints/step-<N>/`, one torch.distributed.checkpoint
(DCP) checkpoint per saved step, committed by a rename.

A step directory holds DCP's `.metadata` and `__<rank>_<i>.distcp` files (each rank writes its
own shards; keys are `checkpoint_key` of the program's state names: parameters by FQN,
optimizer state under `optim.`) and `portable.json`, the manifest of the step, its `meta` and
every file's size and sha256 (written and verified by `checkpoint_manifest`). So plain
`torch.distributed.checkpoint.load(model.state_dict(), checkpoint_id=step_dir)` reads it.
Sharded state is saved as DTensors laid out by `dtensor_layout` (`device_mesh`, `to_dtensor`,
re-exported here).

Commit protocol (`CheckpointStore.save`, collective when torch.distributed is initialized):
rank 0 claims a hidden staging directory beside `step-<N>` (`portable.atomic_dir.Claim`: a
killed writer's leftovers are removed, or a half-swapped previous step put back, by the next
save); every rank writes its shards into it (`dcp.save`, or `dcp.async_save` which first copies
the state to CPU) and hashes the files it wrote; rank 0 writes portable.json (temp + rename),
renames the staging directory to `step-<N>` (the commit) and deletes the oldest committed steps
beyond `keep`; then every rank learns the outcome. Failures are agreed too: every rank raises the
same CheckpointError, the staging directory is removed and older steps are untouched. The ranks
talk over a gloo group of the store's own, so async writes never interleave with training's
collectives, whatever the training backend.

Loading never trusts the directory: `verify` re-checks portable.json and every byte, `load` reads
`.metadata` with `SafeFileSystemReader` (no pickle code runs) and checks every target's global
shape and dtype before DCP's resharding load copies into the targets.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..atomic_dir import Claim, recover_stale
from ..errors import CheckpointError, PortableError
from .checkpoint_manifest import (
    FIX_RESUME,
    MANIFEST,
    STEP_DIR,
    hash_own,
    verify_files,
    write_manifest,
)
from .dcp_reader import SafeFileSystemReader, read_metadata
from .dtensor_layout import device_mesh, to_dtensor

__all__ = [
    "Checkpoint",
    "CheckpointStore",
    "PendingSave",
    "checkpoint_key",
    "device_mesh",
    "to_dtensor",
    "weight_key",
]

# --------------------------------------------------------------------------- state names


def checkpoint_key(weight_key: str) -> str:
    """The checkpoint's name of a program state key: `optimizer.` -> `optim.`, else unchanged."""
    if weight_key.startswith("optimizer."):
        return "optim." + weight_key.removeprefix("optimizer.")
    return weight_key


def weight_key(checkpoint_key: str) -> str:
    """The inverse of `checkpoint_key`: `optim.` -> `optimizer.`."""
    if checkpoint_key.startswith("optim."):
        return "optimizer." + checkpoint_key.removeprefix("optim.")
    return checkpoint_key


def _named(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` keyed by `checkpoint_key` (idempotent: already-mapped keys stay), tensors only."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"state {key!r} is a {type(value).__name__}, not a tensor",
                fix="checkpoint tensors only; put other values in `meta`",
            )
        name = checkpoint_key(key)
        if name in out:
            raise CheckpointError(
                f"state keys {origin[name]!r} and {key!r} are both stored as {name!r}",
                fix="a program names its optimizer state optimizer.*; rename the other key",
            )
        out[name], origin[name] = value, key
    return out


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A committed, verified checkpoint: its step, directory and the job's `meta`."""

    step: int
    path: Path
    meta: dict[str, Any]


class PendingSave:
    """A save in flight; `wait()` returns its Checkpoint or raises its CheckpointError."""

    def __init__(self, run: Callable[[], Checkpoint] | None = None) -> None:
        self._done = threading.Event()
        self._reported = False  # wait() raised the failure once
        self._result: Checkpoint | None = None
        self._error: CheckpointError | None = None
        if run is None:
            return
        self._thread = threading.Thread(target=self._run, args=(run,), name="portable-ckpt")
        self._thread.start()

    @classmethod
    def finished(cls, result: Checkpoint) -> PendingSave:
        pending = cls()
        pending._result = result
        pending._done.set()
        return pending

    def _run(self, run: Callable[[], Checkpoint]) -> None:
        try:
            self._result = run()
        except CheckpointError as exc:
            self._error = exc
        except Exception as exc:  # noqa: BLE001 - reported through wait()
            self._error = CheckpointError(f"the checkpoint save failed: {exc}")
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Checkpoint:
        self._done.wait()
        if self._error is not None:
            self._reported = True
            raise CheckpointError(self._error.what, fix=self._error.fix)
        assert self._result is not None
        return self._result


# --------------------------------------------------------------------------- ranks


class _Ranks:
    """The processes saving together: one (no torch.distributed), or a gloo group of the
    store's own over the ranks of `process_group` (default: the world), made at first use."""

    def __init__(self, process_group: Any) -> None:
        self._parent = process_group
        self._group: Any = None

    @property
    def active(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def group(self) -> Any:
        if self.active and self._group is None:
            if self._parent is None:
                self._group = dist.new_group(backend="gloo")
            else:  # only the members call this
                ranks = dist.get_process_group_ranks(self._parent)
                self._group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return self._group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group()) if self.active else 0

    def gather(self, value: Any) -> list[Any]:
        """Every rank's JSON `value`, in rank order (all ranks call it)."""
        if not self.active:
            return [value]
        group = self.group()
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, size, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        bufs = [torch.zeros_like(padded) for _ in sizes]
        dist.all_gather(bufs, padded, group=group)
        return [
            json.loads(b[: int(s.item())].numpy().tobytes())
            for b, s in zip(bufs, sizes, strict=True)
        ]

    def agree(self, error: PortableError | None) -> None:
        """Raise on every rank the first rank's error, if any rank has one."""
        reports = self.gather(None if error is None else [error.what, error.fix])
        for report in reports:
            if report is not None:
                raise CheckpointError(report[0], fix=report[1])


# --------------------------------------------------------------------------- the store


class CheckpointStore:
    """RUN/checkpoints: step-<N>/ directories, each a DCP checkpoint plus portable.json."""

    def __init__(
        self, root: str | os.PathLike[str], *, keep: int | None = None, process_group: Any = None
    ) -> None:
        if keep is not None and (type(keep) is not int or keep < 1):
            raise CheckpointError(f"keep={keep!r}", fix="keep the last K >= 1 checkpoints, or None")
        self.root = Path(os.path.abspath(root))
        self.keep = keep
        self.skipped: list[tuple[Path, str]] = []
        self._ranks = _Ranks(process_group)
        self._pending: PendingSave | None = None
        self._staging: Any = None  # DCP's DefaultStager, made at the first async save

    # ---- save

    def save(
        self,
        step: int,
        state: Mapping[str, torch.Tensor],
        meta: Mapping[str, Any],
        *,
        async_: bool = False,
    ) -> PendingSave:
        """Write `state` (each rank its local shards, as DTensors, or plain tensors) as
        step-<step>; collective. Sync: returns when every rank sees the commit. Async: returns
        once the state is copied (the caller may change its tensors), `wait()` for the commit.
        A previous save still in flight is waited for first (its failure is raised here)."""
        self._finish_pending()
        if type(step) is not int or step < 0:
            raise CheckpointError(f"step {step!r} is not an int >= 0")
        doc_meta = _json_meta(meta)
        named = _named(state)
        out = self.root / f"step-{step}"
        claim: Claim | None = None
        error: PortableError | None = None
        if self._ranks.rank == 0:
            try:
                claim = self._claim(out)
            except OSError as exc:
                error = _write_error(step, exc, self.root)
        self._ranks.agree(error)
        staging = Path(self._ranks.gather(str(claim.tmp) if claim else None)[0])
        group = self._ranks.group()
        opts: dict[str, Any] = {"process_group": group, "no_dist": not self._ranks.active}
        if not async_:

            def write() -> Any:
                with _single_process_quiet():
                    return dcp.save(named, checkpoint_id=str(staging), **opts)

            return PendingSave.finished(self._finish(step, staging, doc_meta, claim, write))
        try:
            # copies the state to CPU before it returns; writes in DCP's thread
            opts["async_stager"] = self._stager()
            future = dcp.async_save(named, checkpoint_id=str(staging), **opts)
            write = future.result  # type: ignore[union-attr]  # a Future without async staging
        except (Exception, CheckpointException) as exc:  # staging failed: report collectively
            write = functools.partial(_raise, exc)
        self._pending = PendingSave(lambda: self._finish(step, staging, doc_meta, claim, write))
        return self._pending

    def _stager(self) -> Any:
        """One DCP stager for the store's life: it keeps the CPU copies of the state between
        saves (no allocation per save; pinned when CUDA is there). Safe because a save stages
        only after the previous one is written."""
        if self._staging is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            pin = torch.cuda.is_available()
            self._staging = DefaultStager(StagingOptions(pin, False, False, False))
        return self._staging

    def _finish_pending(self) -> None:
        """Wait for the save in flight; raise its failure unless wait() already did."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending._done.wait()
            if not pending._reported:
                pending.wait()

    def _claim(self, out: Path) -> Claim:
        """Rank 0: clean up after killed writers and claim a staging directory for `out`."""
        self.root.mkdir(parents=True, exist_ok=True)
        for lock in self.root.glob(".step-*.tmp-*.lock"):
            recover_stale(self.root / lock.name[1:].split(".tmp-")[0])
        for dead in self.root.glob(".step-*.deleting"):
            shutil.rmtree(dead, ignore_errors=True)
        claim = Claim(out).__enter__()
        try:
            claim.tmp.mkdir()
        except BaseException:
            claim.__exit__(None, None, None)
            raise
        return claim

    def _finish(
        self,
        step: int,
        staging: Path,
        meta: dict[str, Any],
        claim: Claim | None,
        write: Callable[[], Any],
    ) -> Checkpoint:
        """Write, hash, commit; every rank gets the same outcome (collective). Rank 0's claim
        is released however this ends (an interrupt too): the staging directory goes with it."""
        try:
            report: dict[str, Any]
            try:
                write()
                report = {"files": hash_own(staging, self._ranks.rank)}
            except (Exception, CheckpointException) as exc:
                report = {"error": _error_doc(_write_error(step, exc, self.root))}
            reports = self._ranks.gather(report)
            outcome = None
            if claim is not None:
                try:
                    outcome = self._commit(step, meta, claim, reports)
                except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                    outcome = _error_doc(_write_error(step, exc, self.root))
                _release(claim)  # before any rank hears the outcome
                claim = None
            outcome = self._ranks.gather(outcome)[0]
        finally:
            if claim is not None:
                _release(claim)
        if outcome is not None:
            raise CheckpointError(outcome[0], fix=outcome[1])
        return Checkpoint(step, self.root / f"step-{step}", meta)

    def _commit(
        self, step: int, meta: dict[str, Any], claim: Claim, reports: list[dict[str, Any]]
    ) -> list[str] | None:
        """Rank 0: portable.json, the rename, pruning; the error (what, fix) or None."""
        for report in reports:
            if "error" in report:
                return report["error"]
        files: dict[str, Any] = {}
        for report in reports:
            files.update(report["files"])
        try:
            written = {p.name for p in claim.tmp.iterdir()}
            if written != set(files) or ".metadata" not in files:
                raise CheckpointError(
                    f"the ranks wrote {sorted(written)} but hashed {sorted(files)}",
                    fix="the checkpoint directory must be on a file system every rank shares",
                )
            write_manifest(claim.tmp, step, meta, files)
            claim.swap()
            claim.drop_old()
            _fsync_dir(self.root)
        except (OSError, CheckpointError) as exc:
            return _error_doc(_write_error(step, exc, self.root))
        self._prune(step)
        return None

    def _prune(self, saved: int) -> None:
        """Delete committed steps <= `saved` beyond the newest `keep` (later steps, which only a
        resumed run from an older one leaves, are not this save's to judge)."""
        if self.keep is None:
            return
        older = [n for n, p in self._steps() if n <= saved and (p / MANIFEST).is_file()]
        for n in sorted(older, reverse=True)[self.keep :]:
            doomed = self.root / f".step-{n}.deleting"
            try:
                os.rename(self.root / f"step-{n}", doomed)
            except OSError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)

    # ---- find and verify

    def _steps(self) -> list[tuple[int, Path]]:
        try:
            names = [e.name for e in os.scandir(self.root)]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(f"cannot list {self.root}: {exc.strerror}") from exc
        return sorted((int(m[1]), self.root / n) for n in names if (m := STEP_DIR.fullmatch(n)))

    def latest(self) -> Checkpoint | None:
        """The newest committed checkpoint that verifies; newer ones that do not are skipped
        (recorded in `skipped`, warned once each)."""
        for _, path in reversed(self._steps()):
            try:
                return self.verify(path)
            except CheckpointError as exc:
                if all(p != path for p, _ in self.skipped):
                    self.skipped.append((path, str(exc)))
                    warnings.warn(f"skipping checkpoint {path}: {exc}", stacklevel=2)
        return None

    def verify(self, path: str | os.PathLike[str]) -> Checkpoint:
        """The checkpoint at `path` if portable.json is committed and every file it lists is
        there, a regular file with its size and sha256, nothing else is, and `.metadata` reads
        safely; else CheckpointError. Sizes are compared (lstat) before anything is hashed."""
        path = Path(path)
        try:
            step, meta, files = verify_files(path)
        except OSError as exc:  # a file that cannot be listed or read
            raise CheckpointError(
                f"cannot read checkpoint {path}: {exc.strerror or exc}", fix=FIX_RESUME
            ) from exc
        read_metadata(path)  # DCP's metadata readable without running it, its items in place
        return Checkpoint(step, path, meta)

    # ---- load

    def load(self, checkpoint: Checkpoint, targets: Mapping[str, torch.Tensor]) -> None:
        """Copy `checkpoint` into `targets` in place (DTensors with the new plan's placements,
        or plain whole tensors), resharding through DCP; collective. Every target key must be a
        tensor of the same global shape and dtype in the checkpoint (CheckpointError otherwise,
        on every rank, before anything is read)."""
        self._finish_pending()
        named = _named(targets)
        error: PortableError | None = None
        try:
            _check_targets(read_metadata(checkpoint.path), named, checkpoint)
        except CheckpointError as exc:
            error = exc
        self._ranks.agree(error)
        reader = SafeFileSystemReader(checkpoint.path)
        group, no_dist = self._ranks.group(), not self._ranks.active
        try:
            with _single_process_quiet():
                dcp.load(named, storage_reader=reader, process_group=group, no_dist=no_dist)
        except CheckpointException as exc:
            inner = _inner(exc)
            if isinstance(inner, CheckpointError):
                raise CheckpointError(inner.what, fix=inner.fix) from None
            raise CheckpointError(
                f"could not load {checkpoint.path}: {type(inner).__name__}: {inner}",
                fix=FIX_RESUME,
            ) from None


def _check_targets(md: Any, named: Mapping[str, torch.Tensor], checkpoint: Checkpoint) -> None:
    entries = md.state_dict_metadata
    other = "a checkpoint of another program (or of another model size)"
    fix = "resume with the program that wrote it, or start the run in a new RUN directory"
    for key, target in named.items():
        entry = entries.get(key)
        if entry is None:
            raise CheckpointError(
                f"{checkpoint.path} has no {key!r} (the program's {weight_key(key)!r}; it holds "
                f"{len(entries)} entries): {other}",
                fix=fix,
            )
        if not hasattr(entry, "size"):
            raise CheckpointError(
                f"{checkpoint.path} holds {key!r} as bytes, not a tensor", fix=fix
            )
        held = f"{list(entry.size)} {str(entry.properties.dtype).removeprefix('torch.')}"
        wanted = f"{list(target.shape)} {str(target.dtype).removeprefix('torch.')}"
        if held != wanted:
            raise CheckpointError(
                f"{checkpoint.path} holds {key!r} as {held}, the program has {wanted}: {other}",
                fix=fix,
            )


def _inner(exc: CheckpointException) -> BaseException:
    for failure, _trace in exc.failures.values():
        return failure
    return exc


# --------------------------------------------------------------------------- files


def _json_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    try:
        doc = json.loads(json.dumps(dict(meta), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the checkpoint's meta is not JSON: {exc}",
            fix="pass plain dicts, lists, strings, finite numbers, booleans and None",
        ) from None
    return doc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call without torch.distributed that it assumes one process: we ask
    for exactly that (no_dist=True)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _release(claim: Claim) -> None:
    """Remove the staging directory (nothing is left after a commit renamed it) and the lock."""
    claim.remove_tmp()
    claim.__exit__(None, None, None)


def _raise(exc: BaseException) -> None:
    raise exc


def _write_error(step: int, exc: BaseException, root: Path) -> CheckpointError:
    """The CheckpointError for a failed write, with the OSError's reason when there is one."""
    if isinstance(exc, CheckpointError):
        return exc
    inner = _inner(exc) if isinstance(exc, CheckpointException) else exc
    if isinstance(inner, OSError):
        reason = inner.strerror or str(inner)
        fix = (
            f"free space on the disk of {root} (or keep fewer checkpoints: --keep K) and save again"
            if inner.errno in (errno.ENOSPC, errno.EDQUOT)
            else f"check that {root} is writable and its disk healthy, then save again"
        )
    else:
        reason, fix = f"{type(inner).__name__}: {inner}", "see the reason; then save again"
    return CheckpointError(
        f"could not write checkpoint step-{step}: {reason}",
        fix=f"{fix}; the previous checkpoints are intact",
    )


def _error_doc(error: CheckpointError) -> list[str]:
    return [error.what, error.fix or ""]
