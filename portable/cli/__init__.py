"""The `portable` command line: `lower`, `inspect`, `check`, `backends`, `passes`, `ops`.

`main(argv) -> int` (in `app.py`) is the entry point of the console script and of
`python -m portable.cli`. Each command lives in its own module; exit codes are defined once in
`exit_codes.py`. See docs/cli.md.
"""

from __future__ import annotations

from .app import main
from .exit_codes import ExitCode

__all__ = ["ExitCode", "main"]
