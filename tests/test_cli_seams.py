"""The CLI knows no backend or pass by name (issue 14, item 5): `portable/cli/` imports only the
`portable.backends` and `portable.passes` packages themselves (their registries and protocols),
never one backend's or one pass's module. What differs between backends is in their
capabilities, options and stages; what differs between passes is in their reports."""

from __future__ import annotations

import ast
from pathlib import Path

CLI = Path(__file__).resolve().parents[1] / "portable" / "cli"
SEAMS = ("portable.backends", "portable.passes")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in a `portable.cli` module, with each imported
    name as a possible submodule (`from ..backends import cuda` imports `portable.backends.cuda`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _absolute(module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = ["portable", "cli"][: 2 - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _reaches_past_a_seam(module: str) -> bool:
    return any(module.startswith(seam + ".") for seam in SEAMS)


def _public_names(package: str) -> set[str]:
    """The names a seam package exports: importing those from it is the seam itself."""
    import importlib

    return set(getattr(importlib.import_module(package), "__all__", ()))


def test_the_cli_imports_no_backend_or_pass_module():
    exported = {f"{p}.{name}" for p in SEAMS for name in _public_names(p)}
    offenders = [
        f"{path.name}:{line}: {module}"
        for path in sorted(CLI.glob("*.py"))
        for line, module in _imports(path)
        if _reaches_past_a_seam(module) and module not in exported
    ]
    assert offenders == []


def test_the_scan_sees_relative_and_absolute_imports(tmp_path):
    """The check can fail: a module that imports a backend by name is found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from ..backends.neuron.compile import COMPILER\n"
        "import portable.passes.mx_quantize\n"
        "from ..backends import cuda\n"
        "from ..backends import get_backend\n"
    )
    reached = [m for _, m in _imports(bad) if _reaches_past_a_seam(m)]
    exported = {f"{p}.{name}" for p in SEAMS for name in _public_names(p)}
    assert [m for m in reached if m not in exported] == [
        "portable.backends.neuron.compile",
        "portable.backends.neuron.compile.COMPILER",
        "portable.passes.mx_quantize",
        "portable.backends.cuda",
    ]
