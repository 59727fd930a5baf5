"""What went wrong in a failed `portable run` job, said once: which rank, how, and where.

Sources, all in the job's report folder:
- `rank<r>.json`: the PortableError a rank raised (`write_failure`); a CollectiveError there is
  usually a consequence (a peer died or hung), anything else is the rank's own error;
- torchrun's per-rank failures (agent.py): exit code, signal, the exception `@record` saw;
- the heartbeats (heartbeat.py): the phase and step each rank last reached;
- the ranks the launcher ended because they stopped beating (job.py `Hung`).

`job_error` picks the cause in this order: a rank's own PortableError (raised again with its
type), a hung rank, a rank that died or exited on its own, a collective that failed with no other
cause known, torchrun's own failure. Its message names the rank, how it ended (exit status,
signal, or silence and process state) and the step it had reached, with one line per rank.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import errors
from ..errors import BackendError, PortableError
from .heartbeat import Beat
from .job import Hung, Outcome

__all__ = ["RankFailedError", "job_error", "read_reports", "write_failure"]

COLLECTIVE = "CollectiveError"


class RankFailedError(BackendError):
    """A rank of `portable run` died, hung, or failed with an exception that is not a
    PortableError; the message names the rank, how it ended and the step it had reached."""


def write_failure(report: Path, rank: int, exc: PortableError) -> None:
    """Record a rank's PortableError (type, fields) for the launcher to raise again."""
    doc = {
        "rank": rank,
        "type": type(exc).__name__,
        "what": exc.what,
        "fix": exc.fix,
        "op": exc.op,
        "details": exc.details,
    }
    tmp = report / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(report / f"rank{rank}.json")


def read_reports(report: Path) -> dict[int, dict[str, Any]]:
    """Every rank's recorded PortableError, by rank."""
    docs = {}
    for path in report.glob("rank*.json"):
        if path.stem[4:].isdigit():
            docs[int(path.stem[4:])] = json.loads(path.read_text())
    return docs


def job_error(
    nproc: int,
    outcome: Outcome,
    failures: Mapping[int, Mapping[str, Any]],
    reports: Mapping[int, Mapping[str, Any]],
    *,
    timeout_s: float,
) -> PortableError | None:
    """The error a failed job raises (None when it succeeded)."""
    own = {r: d for r, d in reports.items() if d.get("type") != COLLECTIVE}
    if own:
        return _raised_again(own, reports)
    if outcome.returncode == 0 and not outcome.hung and not failures:
        return None
    ranks = _Ranks(nproc, outcome, failures, reports)
    cause = ranks.cause()
    if cause is None:
        tail = outcome.output_tail.strip()
        return BackendError(
            f"torchrun exited with {outcome.returncode} and no rank reported a failure",
            details=tail or ranks.table(),
            fix="torchrun's own output (above) says why"
            + ("" if tail else ", before this message"),
        )
    headline, fix = ranks.explain(cause, timeout_s)
    return RankFailedError(headline, details=ranks.table(), fix=fix)


class _Ranks:
    """The facts about every rank of one job, and how to say them."""

    def __init__(
        self,
        nproc: int,
        outcome: Outcome,
        failures: Mapping[int, Mapping[str, Any]],
        reports: Mapping[int, Mapping[str, Any]],
    ) -> None:
        self.nproc, self.hung, self.beats = nproc, outcome.hung, outcome.beats
        self.failures, self.reports = failures, reports

    def cause(self) -> int | None:
        """The rank that caused the failure: a hung one, else one that died or exited on its
        own, else the first whose collective failed."""
        if self.hung:
            return min(self.hung)
        died = [r for r in self.failures if r not in self.reports]
        if died:
            return min(died, key=self._blame)
        return min(self.reports) if self.reports else None

    def _blame(self, rank: int) -> tuple[bool, bool, float, int]:
        """Sort key, the likeliest cause first. An exception first: torchrun may have stopped
        that rank with SIGTERM after it raised. Then a death by any other means before one by
        SIGTERM: once a rank fails, torchrun SIGTERMs the others and records them as failed too.
        Then the earlier death, then the lower rank."""
        failure = self.failures[rank]
        stopped_by_torchrun = failure.get("signal") == "SIGTERM" and not _raised(failure)
        return (not _raised(failure), stopped_by_torchrun, _when(failure), rank)

    def where(self, rank: int) -> str:
        beat: Beat | None = self.beats.get(rank)
        return beat.where() if beat is not None else "starting up"

    def explain(self, rank: int, timeout_s: float) -> tuple[str, str]:
        """(headline, fix) for the rank that caused the failure."""
        of = f"rank {rank} of {self.nproc}"
        if rank in self.hung:
            hung = self.hung[rank]
            return f"{of} hung in {self.where(rank)}: {_silence(hung)}", _hung_fix(hung, timeout_s)
        if rank in self.failures and rank not in self.reports:
            failure = self.failures[rank]
            how = _ended(failure)
            if not _raised(failure) and failure.get("signal"):
                return f"{of} was {how} in {self.where(rank)}", _signal_fix(rank, failure)
            detail = f": {failure['message']}" if failure.get("message") else ""
            return f"{of} {how} in {self.where(rank)}{detail}", _exception_fix(rank, failure)
        others = [r for r in range(self.nproc) if r not in self.reports]
        absent = f"; rank(s) {', '.join(map(str, others))} did not report" if others else ""
        what = self.reports[rank]["what"]
        return f"{of}: {what}{absent}", (
            f"raise --timeout (now {timeout_s:g}s) if a rank legitimately takes longer between "
            "collectives; otherwise look at the ranks that did not report"
        )

    def table(self) -> str:
        """One line per rank: how it ended and what it had reached."""
        return "\n".join(f"rank {r}: {self._line(r)}" for r in range(self.nproc))

    def _line(self, rank: int) -> str:
        where = self.where(rank)
        pid = self.beats[rank].pid if rank in self.beats else None
        at = f" (pid {pid})" if pid is not None else ""
        if rank in self.hung:
            return f"hung in {where}{at}: {_silence(self.hung[rank])}"
        if rank in self.reports:
            return f"failed in {where}: {self.reports[rank]['what']}"
        if rank in self.failures:
            failure = self.failures[rank]
            message = (
                failure.get("message") if _raised(failure) or not failure.get("signal") else None
            )
            return f"{_ended(failure)} in {where}{at}" + (f": {message}" if message else "")
        return f"stopped when the job ended; it had reached {where}"


def _raised(failure: Mapping[str, Any]) -> bool:
    """The rank raised an exception (`@record` wrote it), whatever ended its process then."""
    return bool(failure.get("traceback"))


def _when(failure: Mapping[str, Any]) -> float:
    stamp = failure.get("timestamp")
    return float(stamp) if isinstance(stamp, (int, float)) else float("inf")


def _ended(failure: Mapping[str, Any]) -> str:
    code = failure.get("exitcode")
    if _raised(failure) and failure.get("signal"):
        return "failed"
    if failure.get("signal"):
        number = -int(code) if isinstance(code, int) else "?"
        return f"killed by signal {failure['signal']} ({number})"
    return f"failed with exit status {code}"


def _silence(hung: Hung) -> str:
    if hung.beat is None:
        return f"it did not start within {hung.silent_s:.1f}s; the job was ended"
    state = f"; its process was {hung.state}" if hung.state else ""
    return f"no heartbeat for {hung.silent_s:.1f}s{state}; the launcher killed it"


def _hung_fix(hung: Hung, timeout_s: float) -> str:
    longer = f"if a rank may legitimately be silent longer, raise --timeout (now {timeout_s:g}s)"
    if hung.state and hung.state.startswith("stopped by a signal"):
        return f"something stopped the process (kill -STOP, Ctrl-Z); {longer}"
    return f"a rank that stops beating is wedged (a debugger shows where: py-spy dump); {longer}"


def _signal_fix(rank: int, failure: Mapping[str, Any]) -> str:
    if failure.get("signal") in ("SIGKILL", "SIGTERM"):
        return (
            f"something outside portable ended rank {rank}: the out-of-memory killer (see dmesg), "
            "a user, or a job scheduler; run again once it is resolved"
        )
    return (
        f"rank {rank} crashed ({failure.get('signal')}): a bug in portable or torch; report it "
        "with the program archive and this command"
    )


def _exception_fix(rank: int, failure: Mapping[str, Any]) -> str:
    trace = (failure.get("traceback") or "").splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    ours = [f for f in frames if f"{os.sep}torch{os.sep}" not in f]  # the innermost not in torch
    at = f" ({(ours or frames)[-1]})" if frames else ""
    return (
        f"rank {rank} raised an exception that is not a portable error{at}: if the model runs in "
        "eager PyTorch on the same inputs, it is a bug in portable's per-rank program or runtime; "
        "report it with the spec, the plan and this message"
    )


def _raised_again(own: Mapping[int, Mapping[str, Any]], reports: Mapping) -> PortableError:
    """The first rank's own PortableError, with its type, naming the rank."""
    from ..cli import exit_codes

    rank = min(own)
    doc = own[rank]
    cls = getattr(errors, doc["type"], None) or getattr(exit_codes, doc["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, PortableError)):
        cls = PortableError
    what = f"rank {rank}: {doc['what']}"
    if len(reports) > 1:
        what += f" (ranks that failed: {', '.join(map(str, sorted(reports)))})"
    fields = {"op": doc.get("op"), "details": doc.get("details"), "fix": doc.get("fix")}
    try:
        return cls(what, **fields)
    except TypeError:  # a subclass with required fields of its own (PassError, LoweringError)
        return PortableError(f"{doc['type']}: {what}", **fields)
