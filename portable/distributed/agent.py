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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .lifetime import die_with_parent

__all__ = ["AGENT_EVENTS_ENV", "AGENT_PID_ENV", "main", "read_failures"]

AGENT_PID_ENV = "PORTABLE_RUN_AGENT_PID"
AGENT_EVENTS_ENV = "PORTABLE_AGENT_EVENTS"  # a JSONL file: when the agent restarted the ranks


def main(argv: Sequence[str] | None = None) -> int:
    failures_file, launcher, *torchrun_args = list(sys.argv[1:] if argv is None else argv)
    die_with_parent(int(launcher))
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _record_restarts(os.environ.get(AGENT_EVENTS_ENV))
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


def _record_restarts(path: str | None) -> None:
    """Append {"detected": t0, "stopped": t1, "started": t2} to `path` each time the elastic
    agent restarts its worker group: t0 when its monitor found the group failed, t1 when the old
    ranks were stopped, t2 when the new ones were started (what `portable drill` reports).
    torch's agent has no public hook for this, so its two steps are wrapped here."""
    if not path:
        return
    from torch.distributed.elastic.agent.server import api

    agent = api.SimpleElasticAgent
    restart, stop = getattr(agent, "_restart_workers", None), getattr(agent, "_stop_workers", None)
    if restart is None or stop is None:
        return  # another torch: the drill reports what the ranks themselves recorded
    stopped: list[float] = []

    def stop_workers(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = stop(self, *args, **kwargs)
        stopped.append(time.time())
        return result

    def restart_workers(self: Any, *args: Any, **kwargs: Any) -> Any:
        detected = time.time()
        result = restart(self, *args, **kwargs)
        doc = {"detected": detected, "stopped": stopped[-1] if stopped else None}
        doc["started"] = time.time()
        with open(path, "a") as f:
            f.write(json.dumps(doc) + "\n")
        return result

    agent._stop_workers = stop_workers  # type: ignore[method-assign]
    agent._restart_workers = restart_workers  # type: ignore[method-assign]


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
