"""`python -m portable.distributed.agent FAILURES LAUNCHER_PID TORCHRUN_ARGS...`: torchrun,
recording how each failed rank ended.

torchrun's elastic agent starts the ranks (each in a session of its own), watches their exit
codes, and stops the others when one fails. Its `ChildFailedError` carries, per global rank, the
exit code (negative: the signal) and what the rank's `@record` wrote to its error file (the
exception and traceback). This module runs `torch.distributed.run` as torchrun does and writes
those failures to FAILURES as JSON for the launcher, which turns them into its own message:

    {"failures": {"1": {"exitcode": -9, "signal": "SIGKILL", "pid": 4242,
                        "message": "...", "traceback": "...", "timestamp": 1765432100}}}

It dies with the launcher (LAUNCHER_PID; lifetime.py) and tells the ranks its pid
(PORTABLE_RUN_AGENT_PID) so that they die with it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .lifetime import die_with_parent

__all__ = ["AGENT_PID_ENV", "main", "read_failures"]

AGENT_PID_ENV = "PORTABLE_RUN_AGENT_PID"


def main(argv: Sequence[str] | None = None) -> int:
    failures_file, launcher, *torchrun_args = list(sys.argv[1:] if argv is None else argv)
    die_with_parent(int(launcher))
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(torchrun_args))
    except SignalException as exc:  # the launcher ended the job: torchrun stopped the ranks
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        doc = {"failures": {str(rank): _failure(f) for rank, f in exc.failures.items()}}
        tmp = Path(f"{failures_file}.tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(failures_file)
        return 1
    return 0


def _failure(failure: Any) -> dict[str, Any]:
    """One ProcessFailure as JSON: the exception's message and traceback when `@record` wrote
    them, else torch's own description (`Signal 9 (SIGKILL) received by PID ...`)."""
    message, traceback = failure.message, None
    if isinstance(message, dict):
        traceback = (message.get("extraInfo") or {}).get("py_callstack")
        message = message.get("message")
    return {
        "exitcode": failure.exitcode,
        "signal": failure.signal_name() if failure.exitcode < 0 else None,
        "pid": failure.pid,
        "message": message,
        "traceback": traceback,
        "timestamp": failure.timestamp,
    }


def read_failures(path: Path) -> dict[int, dict[str, Any]]:
    """FAILURES as written by `main`, by global rank (empty when no rank failed)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {int(rank): failure for rank, failure in doc.get("failures", {}).items()}


if __name__ == "__main__":
    sys.exit(main())
