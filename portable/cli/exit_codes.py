"""Exit codes of the `portable` command, and the one mapping from exceptions to them."""

from __future__ import annotations

import enum

from ..backends import CompilerMissingError
from ..errors import BackendError, PortableError

__all__ = ["CompilerMissingError", "ExitCode", "OutputConflictError", "exit_code_for"]


class ExitCode(enum.IntEnum):
    OK = 0
    PARITY_MISMATCH = 1  # artifacts were written; a backend disagrees with the reference
    USAGE = 2  # bad command line (argparse)
    USER_ERROR = 3  # a PortableError from user input (spec, capture, verify, archive, pass, plan)
    #                 or an OSError reading or writing files
    BACKEND_ERROR = 4  # a backend cannot lower or compile the program; a `portable run` rank failed
    OUTPUT_CONFLICT = 5  # --out exists and holds foreign content, or needs --force
    CHECK_FINDINGS = 6  # `portable check` found problems in the artifacts
    COMPILER_MISSING = 7  # --compile, and a target's compiler (neuronx-cc) is not installed
    COMPILE_FAILED = 8  # --compile: a compiler failed on a program; the output was still written
    INTERNAL_ERROR = 70  # a bug (unexpected exception); the traceback is printed
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); no partial output is left
    TERMINATED = 143  # SIGTERM (128 + SIGTERM); no partial output is left


EPILOG = """exit codes:
  0   ok
  1   parity mismatch (artifacts were still written)
  2   usage error
  3   error in user input: spec, capture, verify, archive, pass or plan,
      or a file that cannot be read or written (`error: ...` on stderr)
  4   a backend cannot lower or compile the program; portable run: a rank died, hung or
      raised something that is not a portable error (the message names it)
  5   output directory conflict (foreign content, or an earlier output without --force)
  6   `portable check` found problems
  7   --compile, but neuronx-cc is not on PATH (checked before capture; nothing written)
  8   --compile: neuronx-cc failed on a program (the output and its logs were still written)
  70  internal error (a bug; the traceback is printed)
  130 interrupted by Ctrl-C (SIGINT); 143: SIGTERM (no partial output is left)"""


class OutputConflictError(PortableError):
    """`--out` names a path that holds foreign content, or an earlier output without --force."""


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit code for an exception that reached the top of a command."""
    if isinstance(exc, OutputConflictError):
        return ExitCode.OUTPUT_CONFLICT
    if isinstance(exc, CompilerMissingError):
        return ExitCode.COMPILER_MISSING
    if isinstance(exc, BackendError):
        return ExitCode.BACKEND_ERROR
    if isinstance(exc, (PortableError, OSError)):
        return ExitCode.USER_ERROR
    return ExitCode.INTERNAL_ERROR
