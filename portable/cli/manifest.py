"""The output manifest (`DIR/manifest.json`): schema constants, file records, toolchain.

`format` is the marker that tells `portable` a directory is its own output (see output.py);
`format_version` bumps when a field changes meaning or disappears. Fields are listed in docs/cli.md.
"""

from __future__ import annotations

import json
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from portable.file_digest import sha256_file

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "file_records",
    "listed_files",
    "read_manifest",
    "toolchain",
    "write_manifest",
]

MANIFEST = "manifest.json"
FORMAT = "portable-lower-output"
FORMAT_VERSION = 1
_PACKAGES = ("portable", "torch", "numpy", "safetensors")


def toolchain() -> dict[str, str | None]:
    """Versions of Python and of the packages that shape the artifacts (None if not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def file_records(root: Path, folder: Path) -> list[dict[str, Any]]:
    """`{path, sha256, size}` for every file under `folder`, paths relative to `root`, sorted."""
    records = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        records.append(
            {
                "path": path.relative_to(root).as_posix(),
                "sha256": sha256_file(path),
                "size": path.stat().st_size,
            }
        )
    return records


def listed_files(manifest: dict[str, Any]) -> set[str]:
    """Every path the manifest records (relative to its directory), plus the manifest itself."""
    records = list(manifest.get("program", {}).get("files", []))
    for target in manifest.get("targets", []):
        records.extend(target.get("files", []))
    return {r["path"] for r in records if isinstance(r, dict) and "path" in r} | {MANIFEST}


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a directory `portable lower` wrote, or None (absent, unreadable, foreign)."""
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def write_manifest(folder: Path, manifest: dict[str, Any]) -> Path:
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path
