"""The `portable` command line: `lower`, `inspect`, `check`, `train`, `drill`, `report`, ...

`main(argv) -> int` (in `app.py`) is the entry point of the console script and of
`python -m portable.cli`. Each command lives in its own module; exit codes are defined once in
`exit_codes.py`. See docs/cli.md.

`main` is loaded on first use: the parser imports every command, and library modules that use
one piece of the CLI (`portable.distributed` its interrupt handling) must not import them all.
"""

from __future__ import annotations

from typing import Any

from .exit_codes import ExitCode

__all__ = ["ExitCode", "main"]


def __getattr__(name: str) -> Any:
    if name == "main":
        from .app import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
