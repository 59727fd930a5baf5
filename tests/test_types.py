"""mypy over the installed package (portable, portable.backends, portable.passes) at the
strictness of pyproject.toml's [tool.mypy] reports no error (docs/testing.md, "Type checking").

Run it alone with `python -m pytest tests/test_types.py`; mypy's cache lives outside the
checkout and is keyed by file contents, so a warm cache only makes the run faster (about 50 s
cold, a few seconds warm, on 2 cores)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(tempfile.gettempdir()) / "portable-mypy-cache"
_CHECKED = re.compile(r"^Success: no issues found in (\d+) source files$", re.M)


def package_root() -> Path:
    """The folder holding the `portable` that `import portable` imports (the installed one)."""
    spec = importlib.util.find_spec("portable")
    assert spec is not None and spec.origin is not None, "portable is not installed"
    return Path(spec.origin).parents[1]


def test_the_package_type_checks():
    pytest.importorskip("mypy")  # the `test` extra installs it
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")]
        + ["--cache-dir", str(CACHE), "-p", "portable"],
        cwd=package_root(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"
    checked = _CHECKED.search(proc.stdout)
    assert checked, proc.stdout
    # every module of the package was checked, backends/ and passes/ included
    modules = len(list((package_root() / "portable").rglob("*.py")))
    assert int(checked[1]) == modules, (checked[0], modules)
