"""`portable` entry point: the argument parser and the one place errors become exit codes.

`main(argv) -> int` never raises for a failed command: usage errors return 2 (argparse prints
the usage); a PortableError or OSError prints `error: <message>` to stderr and returns its
ExitCode (exit_codes.py), with the traceback only under `--debug`; anything else is a bug: the
traceback is printed and 70 returned. With `--json`, a failure also prints
`{"status": "error", "exit_code": N, "error": {"type": ..., "message": ...}}` to stdout.
Ctrl-C (SIGINT) and SIGTERM stop the command (interrupts.py) with one `error:` line and exit
130 / 143 (128 + the signal), after it undid its work (no partial output is left).
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sys
import traceback

from .. import __version__, limits
from ..errors import PortableError
from . import check, data, inspection, listing, lower, plan, report, run, train
from .exit_codes import EPILOG, ExitCode, exit_code_for
from .interrupts import handling_interrupts

__all__ = ["build_parser", "main"]

_MAX_ALLOC_HELP = (
    "largest tensor portable allocates from a declared shape (--parity examples, a program's "
    "intermediates), e.g. 16GiB; default 4GiB"
)


def build_parser() -> argparse.ArgumentParser:
    # `--debug` is accepted before or after the command; SUPPRESS keeps a subcommand's default
    # from overwriting a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print tracebacks for errors",
    )
    common.add_argument("--max-alloc", default=argparse.SUPPRESS, help=_MAX_ALLOC_HELP)
    parser = argparse.ArgumentParser(
        prog="portable",
        description="Capture PyTorch models into the portable IR and lower them to backends.",
        epilog=EPILOG + "\n\nsee docs/cli.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"portable {__version__}")
    parser.add_argument("--debug", action="store_true", help="print tracebacks for errors")
    parser.add_argument("--max-alloc", metavar="SIZE", default=None, help=_MAX_ALLOC_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    lower.add_parser(sub, [common])
    inspection.add_parser(sub, [common])
    check.add_parser(sub, [common])
    listing.add_parsers(sub, [common])
    run.add_parser(sub, [common])
    data.add_parser(sub, [common])
    train.add_parsers(sub, [common])
    report.add_parser(sub, [common])
    plan.add_parser(sub, [common])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `portable` with `argv` (default `sys.argv[1:]`); return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    args.argv = argv
    with handling_interrupts(functools.partial(_interrupt_text, args)):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    try:
        if args.max_alloc is not None:
            limits.configure(max_tensor_bytes=limits.parse_bytes(args.max_alloc))
        return int(args.run(args))
    except (PortableError, OSError) as exc:
        if args.debug:
            traceback.print_exception(exc)
        return _fail(args, exc, exit_code_for(exc))
    except Exception as exc:  # a bug in portable or a backend: show everything
        traceback.print_exception(exc)
        return _fail(args, exc, ExitCode.INTERNAL_ERROR)
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM, after the command undid its work
        if args.debug:
            traceback.print_exception(exc)
        err, out = _interrupt_text(args, getattr(exc, "signum", signal.SIGINT))
        sys.stdout.write(out or "")
        sys.stderr.write(err)
        return getattr(exc, "exit_code", ExitCode.INTERRUPTED)


def _interrupt_text(args: argparse.Namespace, signum: int) -> tuple[str, str | None]:
    """The one line for stderr (and the JSON document for stdout with --json)."""
    how = "interrupted by Ctrl-C (SIGINT)" if signum == signal.SIGINT else "terminated (SIGTERM)"
    message = f"{how}: stopped before finishing; no partial output was left"
    doc = None
    if getattr(args, "json", False):
        error = {"type": "Interrupted", "message": message}
        doc = {"status": "error", "exit_code": 128 + signum, "error": error}
    return f"error: {message}\n", json.dumps(doc, indent=2) + "\n" if doc else None


def _fail(args: argparse.Namespace, exc: Exception, code: ExitCode) -> int:
    if isinstance(exc, PortableError | OSError):
        message = str(exc)
    else:
        message = f"internal error: {type(exc).__name__}: {exc}"
    print(f"error: {message}", file=sys.stderr)
    if getattr(args, "json", False):
        error = {"type": type(exc).__name__, "message": message}
        print(json.dumps({"status": "error", "exit_code": int(code), "error": error}, indent=2))
    return int(code)
