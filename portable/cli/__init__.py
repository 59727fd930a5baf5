"""The `portable` command line: `lower`, `inspect`, `backends`, `passes`, `ops`.

`main(argv) -> int` is the entry point (the console script names `portable.cli.main:main`; this
package re-exports it lazily so that `python -m portable.cli.main` runs a module that was not
imported yet). Each command lives in its own module; exit codes are defined once in
`exit_codes.py`. See docs/cli.md.
"""

from __future__ import annotations

from .exit_codes import ExitCode

__all__ = ["ExitCode", "main"]


def main(argv: list[str] | None = None) -> int:
    """`portable.cli.main.main`: run the CLI with `argv` and return the exit code."""
    from .main import main as run

    return run(argv)
