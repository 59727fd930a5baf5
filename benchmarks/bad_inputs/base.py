"""Scenarios and outcomes of the bad-input catalogue.

A scenario is a function of a scratch directory that returns an outcome:
- `typed(exc)`: the failure reached the caller as a PortableError (or, for a command, a typed
  exit code with one `error:` line);
- `OK`: it worked, and the scenario checked that the result is right;
- `wrong(why)`: a result without an error, and it is wrong (silent wrong);
- `lost(why)`: data that existed before is gone or half-written;
- `crash(why)`: an untyped exception or an internal-error exit reached the caller.
The runner adds `hang` (past the scenario's timeout) and `code` (the canary file in the scratch
directory exists afterwards: a payload ran).

`expect` says how a scenario must end: "typed" (bad input: a typed error), "works" (it must
work, with the right numbers), or "either" (work, or refuse typed with the reason).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from collections.abc import Callable
from pathlib import Path

import portable

OK = "ok"
CANARY = "CANARY"


def typed(exc: BaseException) -> str:
    return f"typed:{type(exc).__name__}"


def wrong(why: str) -> str:
    return f"wrong:{why}"


def lost(why: str) -> str:
    return f"lost:{why}"


def crash(why: str) -> str:
    return f"crash:{why}"


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    category: str  # archive | capture | runtime | cli | signal | rank | numerics
    fn: Callable[[Path], str]
    expect: str = "typed"  # typed | works | either
    quick: bool = True  # part of the quick form (CI runs it)
    timeout: float = 180.0
    must_say: str = ""  # a typed error's message must contain this (its fix)


def refused(fn: Callable[[], object], must_say: str = "") -> str:
    """Run `fn`; a PortableError (naming `must_say`) is the typed outcome, anything else
    raised is a crash, and returning is OK (the caller decides whether it should have)."""
    try:
        fn()
    except portable.PortableError as exc:
        if must_say and must_say not in str(exc):
            return crash(f"typed {type(exc).__name__} without {must_say!r}: {str(exc)[:160]}")
        return typed(exc)
    except Exception as exc:  # noqa: BLE001 - counting exactly these is the point
        return crash(f"{type(exc).__name__}: {str(exc)[:160]}")
    return OK


def cli(argv: list[str]) -> tuple[int, str]:
    """`portable ARGV` in this process: (exit code, stderr)."""
    from portable.cli.app import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


def cli_outcome(argv: list[str], *, want: int | tuple[int, ...] = 3, must_say: str = "") -> str:
    """A command that must fail typed: exit `want`, an `error:` line naming `must_say`, no
    traceback; exit 0 is OK (accepted), 70 or a traceback is a crash."""
    code, err = cli(argv)
    wants = (want,) if isinstance(want, int) else want
    if code == 0:
        return OK
    if code == 70 or "Traceback" in err:
        return crash(f"exit {code}: {err.strip().splitlines()[-1][:160] if err.strip() else ''}")
    if code not in wants or "error:" not in err or (must_say and must_say not in err):
        return crash(f"exit {code} (expected {wants}): {err.strip()[:200]}")
    return f"typed:exit {code}"
