"""Program archives: a directory holding `program.json` and `weights.safetensors`.

    program.save("model.portable")          # == portable.archive.save(program, path)
    program = portable.load("model.portable")

Contracts (docs/archive-format.md is the schema):
- `load(save(p, path))` equals `p`: same text, signature, plan, metadata and content hash, and
  bit-identical weights (same dtypes).
- No pickle: JSON and safetensors only; loading executes no code from the archive.
- `save` is atomic: it writes a sibling temp directory and renames it into place, so `path` is
  never a half-written archive. It replaces an existing archive, and refuses to replace anything
  else (a file, a non-empty directory that is not an archive).
- `load` checks the format and opset versions, the weights file's size and sha256, the content
  hash, then runs the verifier; every problem with the archive is an ArchiveError.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from .errors import ArchiveError
from .ir.program import Program
from .ir.serialize import (
    doc_hash,
    doc_structure_bytes,
    program_from_json,
    program_hash,
    program_to_json,
    structure_bytes,
)

__all__ = ["FORMAT_VERSION", "load", "save"]

FORMAT = "portable.program"
FORMAT_VERSION = 1
PROGRAM_FILE = "program.json"
WEIGHTS_FILE = "weights.safetensors"
_ENTRIES = frozenset({PROGRAM_FILE, WEIGHTS_FILE})
_CHUNK = 1 << 20


# --- save -----------------------------------------------------------------------------------


def save(program: Program, path: str | os.PathLike[str]) -> Path:
    """Verify `program` and write it as an archive directory at `path`; return that path."""
    from .verify import verify

    verify(program)
    doc = program_to_json(program)
    if doc_structure_bytes(doc) != structure_bytes(program):
        raise ArchiveError(
            f"cannot save {program.name}: its plan or signature does not survive JSON "
            "(e.g. a plan that names one tensor twice)",
            fix="give each tensor one partition spec in the plan",
        )
    dest = Path(os.path.abspath(path))
    _check_replaceable(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{secrets.token_hex(4)}"
    tmp.mkdir()  # not mkdtemp: the archive gets the umask's permissions, not 0700
    try:
        weights_file = tmp / WEIGHTS_FILE
        safetensors.torch.save_file(_savable(program.weights), weights_file)
        size, digest = _file_digest(weights_file)
        header = _header(program_hash(program), size, digest)
        _write_fsynced(tmp / PROGRAM_FILE, (_dumps({**header, "program": doc}) + "\n").encode())
        os.chmod(weights_file, (tmp / PROGRAM_FILE).stat().st_mode & 0o777)  # safetensors uses 0600
        _fsync(weights_file)
        _fsync(tmp)
        _install(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(dest.parent)
    return dest


def _header(content_hash: str, size: int, digest: str) -> dict[str, Any]:
    from . import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "writer": {"portable": __version__, "torch": torch.__version__.split("+")[0]},
        "content_hash": content_hash,
        "weights": {"file": WEIGHTS_FILE, "bytes": size, "sha256": digest},
    }


def _savable(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors with one storage each (safetensors refuses shared memory)."""
    out, seen = {}, set()
    for key in sorted(weights):
        t = weights[key].detach().cpu()
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        if not t.is_contiguous() or (ptr is not None and ptr in seen):
            t = t.contiguous().clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out[key] = t
    return out


def _dumps(value: Any, depth: int = 0) -> str:
    """JSON that reads well and diffs by line: objects that do not fit a line are split one key
    per line, long lists one element per line (so the graph is one node per line)."""
    flat = json.dumps(value, allow_nan=False)
    if not isinstance(value, (dict, list)) or not value or len(flat) <= 100 - 2 * depth:
        return flat
    pad, end = "  " * (depth + 1), "  " * depth
    if isinstance(value, list):
        lines = [pad + json.dumps(v, allow_nan=False) for v in value]
        return "[\n" + ",\n".join(lines) + "\n" + end + "]"
    lines = [f"{pad}{json.dumps(k)}: {_dumps(v, depth + 1)}" for k, v in value.items()]
    return "{\n" + ",\n".join(lines) + "\n" + end + "}"


def _check_replaceable(dest: Path) -> None:
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        return
    if _is_archive(dest):
        return
    kind = "file" if dest.is_file() else "directory that is not a portable archive"
    raise ArchiveError(
        f"refusing to overwrite {dest}: it is a {kind}",
        fix="choose another path, or delete it first if you mean to replace it",
    )


def _is_archive(dest: Path) -> bool:
    if dest.is_symlink() or not dest.is_dir() or not set(os.listdir(dest)) <= _ENTRIES:
        return False
    try:
        header = json.loads((dest / PROGRAM_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


def _install(tmp: Path, dest: Path) -> None:
    """Rename `tmp` to `dest`; an existing `dest` is moved aside first and restored on failure."""
    if not dest.exists():
        os.rename(tmp, dest)
        return
    old = dest.parent / f".{dest.name}.old-{secrets.token_hex(4)}"
    os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(old, dest)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_fsynced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk (directories: best effort, not every OS allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _file_digest(path: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# --- load -----------------------------------------------------------------------------------


def load(path: str | os.PathLike[str]) -> Program:
    """Read, check and verify the archive at `path` (ArchiveError on any problem with it)."""
    from .verify import verify

    root = Path(path)
    header = _read_header(root)
    doc = header["program"]
    _check_opset(root, doc)
    weights = _read_weights(root, header["weights"])
    expected, actual = header["content_hash"], doc_hash(doc, weights)
    if expected != actual:
        raise ArchiveError(
            f"{root}: content hash mismatch: expected {expected} got {actual}",
            fix="the graph, signature, plan or weights were modified after saving; "
            "re-save the archive from the original program",
        )
    program = program_from_json(doc, weights)
    if structure_bytes(program) != doc_structure_bytes(doc):
        raise ArchiveError(
            f"{root}: {PROGRAM_FILE} does not rebuild to the program it describes",
            fix="re-save the archive with this portable version",
        )
    verify(program)
    return program


def _read_header(root: Path) -> dict[str, Any]:
    if not root.exists():
        raise ArchiveError(
            f"no archive at {root}",
            fix="check the path; archives are written by program.save(path)",
        )
    if not root.is_dir():
        raise ArchiveError(
            f"{root} is not a portable archive (a directory with {PROGRAM_FILE} and {WEIGHTS_FILE})",
            fix="pass the archive directory written by program.save(path)",
        )
    for name in (PROGRAM_FILE, WEIGHTS_FILE):
        if not (root / name).is_file():
            raise ArchiveError(
                f"archive {root} has no {name}",
                fix="the archive is incomplete; re-save it from the original program",
            )
    try:
        header = json.loads((root / PROGRAM_FILE).read_bytes(), parse_constant=_reject_constant)
    except ValueError as exc:
        raise ArchiveError(
            f"{root / PROGRAM_FILE} is not valid JSON: {exc}",
            fix="the file is corrupted; re-save the archive from the original program",
        ) from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ArchiveError(
            f"{root / PROGRAM_FILE} is not a portable program (format is not {FORMAT!r})",
            fix="pass the archive directory written by program.save(path)",
        )
    _check_format_version(header.get("format_version"))
    for key, kind in (("program", dict), ("weights", dict), ("content_hash", str)):
        if not isinstance(header.get(key), kind):
            raise ArchiveError(
                f"{root / PROGRAM_FILE} has no valid {key!r}",
                fix="the file was edited or truncated; re-save the archive from the original program",
            )
    return header


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _check_format_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArchiveError(f"unknown archive format_version {version!r}", fix="re-save the archive")
    if version > FORMAT_VERSION:
        raise ArchiveError(
            f"the archive was written by a newer portable (format {version} > {FORMAT_VERSION})",
            fix="upgrade portable",
        )


def _check_opset(root: Path, doc: dict[str, Any]) -> None:
    from .opset import OPSET_VERSION

    ours = _parse_opset(OPSET_VERSION)
    assert ours is not None, OPSET_VERSION  # our own constant
    recorded = doc.get("opset_version")
    theirs = _parse_opset(recorded)
    if theirs is None:
        raise ArchiveError(f"{root}: bad opset_version {recorded!r}", fix="re-save the archive")
    if theirs[0] > ours[0] or (theirs[0] == ours[0] and theirs[1] > ours[1]):
        raise ArchiveError(
            f"{root} uses opset {recorded}, newer than this portable's {OPSET_VERSION}",
            fix="upgrade portable",
        )
    if theirs[0] < ours[0]:
        raise ArchiveError(
            f"{root} uses opset {recorded}, whose ops changed in opset {ours[0]}.0",
            fix="re-capture the model with this portable, or load it with the portable that wrote it",
        )


def _parse_opset(version: Any) -> tuple[int, int] | None:
    if not isinstance(version, str):
        return None
    major, _, minor = version.partition(".")
    return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None


def _read_weights(root: Path, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    path = root / WEIGHTS_FILE
    size, digest = _file_digest(path)
    want_size, want_digest = info.get("bytes"), info.get("sha256")
    if info.get("file") != WEIGHTS_FILE:
        raise ArchiveError(
            f"{root / PROGRAM_FILE} names weights file {info.get('file')!r}, not {WEIGHTS_FILE!r}",
            fix="the file was edited; re-save the archive from the original program",
        )
    if size != want_size:
        what = (
            "is truncated"
            if isinstance(want_size, int) and size < want_size
            else "has the wrong size"
        )
        raise ArchiveError(
            f"{path} {what}: {size} bytes, expected {want_size}",
            fix="the weights file is incomplete or corrupted; re-save or re-copy the archive",
        )
    if digest != want_digest:
        raise ArchiveError(
            f"{path}: weights hash mismatch: expected {want_digest} got {digest}",
            fix="the weights file is corrupted or was replaced; re-save or re-copy the archive",
        )
    try:
        return safetensors.torch.load_file(path)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ArchiveError(
            f"{path} is not a valid safetensors file: {exc}", fix="re-save the archive"
        ) from exc
