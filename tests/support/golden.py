"""Golden-text comparison: a test's text against a checked-in file.

With `PORTABLE_UPDATE_GOLDEN=1` in the environment, `check_golden` writes the text to the file
instead of comparing (then review `git diff` and commit); docs/testing.md, "IR-text tests"."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

UPDATE_ENV = "PORTABLE_UPDATE_GOLDEN"


def updating() -> bool:
    """Whether this run rewrites golden files (`PORTABLE_UPDATE_GOLDEN=1`)."""
    return os.environ.get(UPDATE_ENV, "") not in ("", "0")


def check_golden(path: Path, text: str) -> None:
    """Assert that `path` holds exactly `text` (a unified diff on mismatch); in update mode,
    write it."""
    if updating():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing: run with {UPDATE_ENV}=1 to write it"
    want = path.read_text()
    if want != text:
        diff = difflib.unified_diff(
            want.splitlines(keepends=True),
            text.splitlines(keepends=True),
            fromfile=str(path),
            tofile="actual",
        )
        raise AssertionError(
            f"{path.name} differs (rerun with {UPDATE_ENV}=1 to accept):\n" + "".join(diff)
        )
