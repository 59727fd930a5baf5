"""`portable.json`, the manifest of a checkpoint step directory: what `CheckpointStore` writes
at the commit and what `verify` checks before a step is trusted.

The document is {"format": "portable-checkpoint", "format_version": 1, "step", "meta",
"files": {name: {"bytes", "sha256"}}}, listing every file of the directory but itself (DCP's
`.metadata` among them). `hash_own` digests the files one rank wrote; `write_manifest` writes the
document (temp file, fsync, rename); `verify_files` accepts a directory only when the manifest
is a regular file whose fields all check, its step is N of a directory named `step-<N>`,
every listed file is there as a regular file (never a symlink) of its listed size and sha256,
and nothing unlisted is. Sizes are compared (lstat) before anything is hashed. Every refusal is
a CheckpointError; a file that cannot be listed or read raises its OSError (the store reports it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..safe_json import read_json

__all__ = [
    "FIX_RESUME",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "STEP_DIR",
    "hash_own",
    "verify_files",
    "write_manifest",
]

FORMAT = "portable-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "portable.json"
STEP_DIR = re.compile(r"step-(0|[1-9][0-9]{0,17})")  # a committed step's directory name
_PLAIN = re.compile(r"(?!\.\.?$)[A-Za-z0-9_.][A-Za-z0-9_.\-]{0,254}")  # no '/', '.', '..'
_SHA = re.compile(r"[0-9a-f]{64}")
_OWNER = re.compile(r"__([0-9]+)_")  # DCP names a rank's files __<rank>_<i>.distcp
FIX_RESUME = (
    "resume from an earlier checkpoint (CheckpointStore.latest() skips this one), or delete it"
)


# --------------------------------------------------------------------------- writing


def hash_own(staging: Path, rank: int) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", "sha256"}} of the files of `staging` this rank wrote (rank 0: also those
    no rank's prefix names, such as .metadata)."""
    out = {}
    for entry in os.scandir(staging):
        owner = _OWNER.match(entry.name)
        if (int(owner[1]) if owner else 0) == rank:
            size = entry.stat(follow_symlinks=False).st_size
            out[entry.name] = {"bytes": size, "sha256": _sha256(Path(entry.path), size)}
    return out


def _sha256(path: Path, size: int) -> str:
    digest = hashlib.sha256()
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    with os.fdopen(os.open(path, flags), "rb") as f:
        while size >= 0 and (chunk := f.read(min(1 << 20, size + 1))):
            digest.update(chunk)
            size -= len(chunk)
    return digest.hexdigest()


def write_manifest(
    directory: Path, step: int, meta: dict[str, Any], files: Mapping[str, dict[str, Any]]
) -> None:
    """Write `directory`/portable.json for `step`: `meta` and every file's bytes and sha256."""
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step}
    doc.update(meta=meta, files=dict(sorted(files.items())))
    _write_json(directory / MANIFEST, doc)


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write((json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, path)


# --------------------------------------------------------------------------- verifying


def verify_files(path: Path) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]]]:
    """(step, meta, files) of a committed directory whose files all match portable.json."""
    _regular(path, directory=True, what="checkpoint directory")
    manifest = path / MANIFEST
    if not os.path.lexists(manifest):
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it was never committed (a save that did not finish, "
            "or a copy without it)",
            fix=FIX_RESUME,
        )
    _regular(manifest, directory=False, what=MANIFEST)
    step, meta, files = _manifest(read_json(manifest, CheckpointError, fix=FIX_RESUME), path)
    _check_listing(path, files)
    for name, entry in files.items():
        size = _regular(path / name, directory=False, what="checkpoint file")
        if size != entry["bytes"]:
            change = "truncated" if size < entry["bytes"] else "grown"
            raise CheckpointError(
                f"{path / name} is {size} bytes, {MANIFEST} lists {entry['bytes']}: {change}",
                fix=FIX_RESUME,
            )
    for name, entry in files.items():
        if _sha256(path / name, entry["bytes"]) != entry["sha256"]:
            raise CheckpointError(
                f"{path / name} does not match its sha256 in {MANIFEST}: corrupted",
                fix=FIX_RESUME,
            )
    return step, meta, files


def _regular(path: Path, *, directory: bool, what: str) -> int:
    """lstat `path`: a directory or a regular file as asked, never a symlink; its size."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise CheckpointError(f"{what} {path} is missing ({exc.strerror})", fix=FIX_RESUME) from exc
    ok = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not ok:
        kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        kind = "not a directory" if directory and kind != "a symlink" else kind
        raise CheckpointError(f"{what} {path} is {kind}", fix=FIX_RESUME)
    return info.st_size


def _manifest(doc: Any, path: Path) -> tuple[int, dict[str, Any], dict[str, dict[str, Any]]]:
    """(step, meta, files) of a portable.json document, every field checked."""
    where = f"{path / MANIFEST}"

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where} {what}", fix=FIX_RESUME)

    keys = {"format", "format_version", "step", "meta", "files"}
    if type(doc) is not dict or set(doc) != keys:
        raise bad(f"is not a checkpoint manifest (it must hold exactly {sorted(keys)})")
    if doc["format"] != FORMAT:
        raise bad(f"has format {str(doc['format'])[:80]!r}, not {FORMAT!r}")
    if doc["format_version"] != FORMAT_VERSION or type(doc["format_version"]) is not int:
        raise CheckpointError(
            f"{where} has format_version {str(doc['format_version'])[:20]}; this portable "
            f"reads {FORMAT_VERSION}",
            fix="load it with the portable version that wrote it",
        )
    step, meta, files = doc["step"], doc["meta"], doc["files"]
    if type(step) is not int or step < 0 or type(meta) is not dict or type(files) is not dict:
        raise bad("has a step that is not an int >= 0, or meta / files that are not objects")
    named = STEP_DIR.fullmatch(path.name)
    if named and int(named[1]) != step:
        raise bad(f"is for step {step}, in directory {path.name}")
    for name, entry in files.items():
        if not _PLAIN.fullmatch(name) or name == MANIFEST:
            raise bad(f"lists {name[:80]!r}, not a plain file name")
        if (
            type(entry) is not dict
            or set(entry) != {"bytes", "sha256"}
            or type(entry["bytes"]) is not int
            or entry["bytes"] < 0
            or type(entry["sha256"]) is not str
            or not _SHA.fullmatch(entry["sha256"])
        ):
            raise bad(f"lists {name!r} without bytes and a sha256")
    if ".metadata" not in files:
        raise bad("lists no .metadata: not a DCP checkpoint")
    return step, meta, files


def _check_listing(path: Path, files: Mapping[str, Any]) -> None:
    """Every listed file present, nothing unlisted (stops at the first extra entry)."""
    seen = set()
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name == MANIFEST:
                continue
            if entry.name not in files:
                raise CheckpointError(
                    f"{path} holds {entry.name!r}, which {MANIFEST} does not list",
                    fix=FIX_RESUME,
                )
            seen.add(entry.name)
    missing = sorted(set(files) - seen)
    if missing:
        raise CheckpointError(
            f"{path} lacks {missing[:5]} listed in {MANIFEST}: incomplete", fix=FIX_RESUME
        )
