"""Program archives: a directory holding `program.json` and `weights.safetensors`.

    program.save("model.portable")          # == portable.archive.save(program, path)
    program = portable.load("model.portable")

Contracts (docs/archive-format.md is the schema):
- `load(save(p, path))` equals `p`: same text, signature, plan, metadata and content hash, and
  bit-identical weights (same dtypes).
- No pickle: JSON and safetensors only; loading executes no code from the archive.
- `save` is atomic (`portable.atomic_dir`): it writes a sibling temp directory and renames it into
  place, so `path` is never a half-written archive, an exception of any kind during the swap puts
  the previous archive back, and what a killed save left is cleaned up by the next save to
  `path`. It replaces an existing archive, and refuses to replace anything else (a file, a
  non-empty directory that is not an archive).
- `load` treats the archive as hostile (docs/archive-format.md, "Threat model"): entries must be
  regular files inside the archive (no links out, no FIFOs or devices), program.json is bounded in
  size and nesting (`portable.limits`), every string that reaches generated code is checked
  against its grammar, then the format and opset versions, the weights file's size and sha256, the
  content hash and the verifier. Every problem with the archive is an ArchiveError (a VerifyError
  from the verifier); none executes code from the archive.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from . import atomic_dir
from .errors import ArchiveError
from .ir.content_hash import (
    HASH_VERSION,
    doc_hash,
    doc_structure_bytes,
    program_hash,
    structure_bytes,
)
from .ir.grammar import bad_text
from .ir.program import Persistence, Program, register_persistence
from .ir.serialize import program_from_json, program_to_json
from .limits import current
from .opset import OPSET_VERSION
from .safe_json import parse_json
from .verify import verify
from .version import __version__

__all__ = ["FORMAT_VERSION", "load", "save"]

FORMAT = "portable.program"
FORMAT_VERSION = 2  # 2: the content hash covers the metadata and the whole plan
PROGRAM_FILE = "program.json"
WEIGHTS_FILE = "weights.safetensors"
_ENTRIES = frozenset({PROGRAM_FILE, WEIGHTS_FILE})
_CHUNK = 1 << 20


# --- save -----------------------------------------------------------------------------------


def save(program: Program, path: str | os.PathLike[str]) -> Path:
    """Verify `program` and write it as an archive directory at `path`; return that path.
    An abstract program (no weight values) is refused: an archive holds weights."""
    program.require_values("saving")
    verify(program)
    doc = program_to_json(program)
    if doc_structure_bytes(doc) != structure_bytes(program):
        raise ArchiveError(
            f"cannot save {program.name}: its plan or signature does not survive JSON "
            "(e.g. a plan that names one tensor twice)",
            fix="give each tensor one partition spec in the plan",
        )
    with atomic_dir.staging(Path(path), check=_check_replaceable) as tmp:
        weights_file = tmp / WEIGHTS_FILE
        safetensors.torch.save_file(_savable(program.weights), weights_file)
        size, digest = _file_digest(weights_file)
        header = _header(program_hash(program), size, digest)
        _write_fsynced(tmp / PROGRAM_FILE, (_dumps({**header, "program": doc}) + "\n").encode())
        os.chmod(weights_file, (tmp / PROGRAM_FILE).stat().st_mode & 0o777)  # safetensors: 0600
        _fsync(weights_file)
        _fsync(tmp)
    dest = Path(os.path.abspath(path))
    _fsync(dest.parent)
    return dest


def _header(content_hash: str, size: int, digest: str) -> dict[str, Any]:
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
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


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
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


# --- load -----------------------------------------------------------------------------------


def load(path: str | os.PathLike[str], *, expected_hash: str | None = None) -> Program:
    """Read, check and verify the archive at `path` (ArchiveError on any problem with it).

    `expected_hash` pins the program: the archive must hold exactly the program whose
    `content_hash` you obtained from a source you trust (see "Threat model" in
    docs/archive-format.md: the hash in the file proves integrity, not who wrote it)."""
    root = Path(path)
    header = _read_header(root)
    doc = header["program"]
    _check_opset(root, doc)
    weights = _read_weights(root, header["weights"])
    version = 1 if header["format_version"] == 1 else HASH_VERSION
    expected, actual = header["content_hash"], doc_hash(doc, weights, version)
    if expected != actual:
        raise ArchiveError(
            f"{root}: content hash mismatch: expected {_cut(expected)} got {actual}",
            fix="the graph, signature, plan, metadata or weights were modified after saving; "
            "re-save the archive from the original program",
        )
    program = program_from_json(doc, weights)
    if structure_bytes(program) != doc_structure_bytes(doc):
        raise ArchiveError(
            f"{root}: {PROGRAM_FILE} does not rebuild to the program it describes",
            fix="re-save the archive with this portable version",
        )
    if expected_hash is not None and program.content_hash != expected_hash:
        raise ArchiveError(
            f"{root} holds program {program.content_hash}, not the expected {_cut(expected_hash)}",
            fix="the archive is not the one you were given the hash of; get it again from its source",
        )
    verify(program)
    return program


def _cut(text: object, limit: int = 80) -> str:
    value = str(text)
    return value if len(value) <= limit else value[:limit] + "..."


def _entry(root: Path, name: str) -> Path:
    """`root/name`, refused unless it is a regular file inside the archive directory: a link
    may not lead out of it (and nothing about a target outside is disclosed), and a FIFO,
    socket or device, which would hang or never end a read, is not a file."""
    path = root / name
    if path.is_symlink():
        path = Path(os.path.realpath(path))
        if not path.is_relative_to(Path(os.path.realpath(root))):
            raise ArchiveError(
                f"archive {root}: {name} is a link that leads out of the archive",
                fix="archives hold their own files; copy the archive with links resolved "
                "(cp -rL) if you trust where they point",
            )
    try:
        info = path.stat()
    except OSError:
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        raise ArchiveError(
            f"archive {root} has no {name}"
            + ("" if info is None else " (it is not a regular file)"),
            fix="the archive is incomplete; re-save it from the original program",
        )
    return path


def _read_file(path: Path, limit: int | None) -> bytes:
    """The bytes of a regular file opened without following a final link; ArchiveError when it
    is over `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise ArchiveError(
            f"{path} is over {limit} bytes",
            fix="a program.json this large is not one portable wrote; if it is, raise "
            "portable.limits max_json_bytes",
        )
    return data


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
        _entry(root, name)
    limits = current()
    header = parse_json(
        _read_file(_entry(root, PROGRAM_FILE), limits.max_json_bytes),
        str(root / PROGRAM_FILE),
        ArchiveError,
        fix="the file is corrupted; re-save the archive from the original program",
    )
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


def _check_format_version(version: Any) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ArchiveError(
            f"unknown archive format_version {_cut(repr(version))}", fix="re-save the archive"
        )
    if version > FORMAT_VERSION:
        raise ArchiveError(
            f"the archive was written by a newer portable (format {version} > {FORMAT_VERSION})",
            fix="upgrade portable",
        )


def _check_opset(root: Path, doc: dict[str, Any]) -> None:
    ours = _parse_opset(OPSET_VERSION)
    assert ours is not None, OPSET_VERSION  # our own constant
    recorded = doc.get("opset_version")
    theirs = _parse_opset(recorded)
    if theirs is None:
        raise ArchiveError(
            f"{root}: bad opset_version {_cut(repr(recorded))}", fix="re-save the archive"
        )
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
    if not isinstance(version, str) or _OPSET.fullmatch(version) is None:
        return None
    major, _, minor = version.partition(".")
    return int(major), int(minor)


_OPSET = re.compile(r"[0-9]{1,6}\.[0-9]{1,6}")


def _read_weights(root: Path, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    want_size, want_digest = info.get("bytes"), info.get("sha256")
    if info.get("file") != WEIGHTS_FILE:
        raise ArchiveError(
            f"{root / PROGRAM_FILE} names weights file {_cut(repr(info.get('file')))}, "
            f"not {WEIGHTS_FILE!r}",
            fix="the file was edited; re-save the archive from the original program",
        )
    path = _entry(root, WEIGHTS_FILE)
    size, digest = _file_digest(path)
    if size != want_size:
        what = (
            "is truncated"
            if isinstance(want_size, int) and size < want_size
            else "has the wrong size"
        )
        raise ArchiveError(
            f"{path} {what}: {size} bytes, expected {_cut(want_size)}",
            fix="the weights file is incomplete or corrupted; re-save or re-copy the archive",
        )
    if digest != want_digest:
        raise ArchiveError(
            f"{path}: weights hash mismatch: expected {_cut(want_digest)} got {digest}",
            fix="the weights file is corrupted or was replaced; re-save or re-copy the archive",
        )
    try:
        weights = safetensors.torch.load_file(path)
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ArchiveError(
            f"{path} is not a valid safetensors file: {_cut(exc, 200)}", fix="re-save the archive"
        ) from exc
    for key in weights:
        if (why := bad_text(key, limit=1024)) is not None:
            raise ArchiveError(f"{path} has a weight key that {why}", fix="re-save the archive")
    return weights


# Program.save and Program.content_hash call these (the IR does not import its storage).
register_persistence(Persistence(save=save, content_hash=program_hash))
