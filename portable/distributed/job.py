"""One `portable run` job: torchrun in a session of its own, watched, and ended whole.

torchrun's elastic agent (agent.py) is the supervisor: it starts the ranks, each in a session of
its own, sees a rank exit or die, and stops the others. Two things it cannot do, and `Job` does:

- see a rank that is alive but silent: stopped (SIGSTOP, Ctrl-Z) or wedged. `wait` polls every
  rank's heartbeat (heartbeat.py); a rank whose last beat is older than `timeout_s` (or that has
  not beaten `startup_s` after the start) is hung: its process state is noted (Linux /proc:
  stopped, running, ...) and its process group killed with SIGKILL, which ends even a stopped
  process; torchrun then stops the other ranks as for any failed rank;
- make sure nothing of the job outlives it. `end` (always, on the way out: an error, Ctrl-C)
  sends SIGTERM to torchrun's process group if it still runs (torchrun stops its ranks), SIGKILL
  after `END_GRACE_S`, then SIGKILL to the process group of every rank still alive (their pids
  come from their heartbeats; a pid is killed only if its command line names this job's report
  folder). So no rank is left reparented to init, and none holds the caller's stdout. When
  `portable` itself ends at once (a second Ctrl-C: cli/interrupts.py), `kill_now` does the
  SIGKILLs without waiting.

Ranks and torchrun also die with their parent (lifetime.py), which covers a launcher killed -9.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ..cli.interrupts import abandon_on_stop
from .heartbeat import Beat, read_beats

__all__ = ["END_GRACE_S", "Hung", "Job", "Outcome"]

POLL_S = 0.1
END_GRACE_S = 5.0  # after SIGTERM, how long torchrun has to stop its ranks
LOG = "torchrun.log"
_HAS_PROC = Path("/proc/self/stat").exists()

_STATES = {  # Linux /proc/PID/stat state letters
    "R": "running",
    "S": "sleeping",
    "D": "waiting on the disk (uninterruptible)",
    "T": "stopped by a signal (SIGSTOP, SIGTSTP or Ctrl-Z)",
    "t": "stopped by a debugger",
}


@dataclasses.dataclass(frozen=True)
class Hung:
    """A rank the job ended because it stopped beating."""

    rank: int
    beat: Beat | None  # None: it never started beating
    silent_s: float
    state: str | None  # its process state when it was ended (Linux), e.g. "stopped by a signal"
    at: float = 0.0  # when it was found silent (epoch seconds)


@dataclasses.dataclass(frozen=True)
class Outcome:
    returncode: int
    hung: dict[int, Hung]
    beats: dict[int, Beat]  # every rank's last heartbeat
    output_tail: str  # the end of torchrun's output (when it was captured)


class Job:
    """torchrun `cmd` for `nproc` ranks beating into `report`; use as a context manager."""

    def __init__(
        self,
        cmd: Sequence[str],
        report: Path,
        *,
        nproc: int,
        timeout_s: float,
        startup_s: float,
        capture_output: bool,
        env: dict[str, str],
    ) -> None:
        self.cmd, self.report, self.nproc = list(cmd), report, nproc
        self.timeout_s, self.startup_s = timeout_s, startup_s
        self.capture_output, self.env = capture_output, env
        self.hung: dict[int, Hung] = {}
        self._proc: subprocess.Popen | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Job:
        self._stack.enter_context(abandon_on_stop(self.kill_now))  # `portable` ends at once
        log = open(self.report / LOG, "w") if self.capture_output else None  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                start_new_session=True,  # its own process group: killed as one
            )
        finally:
            if log is not None:
                log.close()
        self._started = time.time()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.end()
        finally:
            self._stack.close()

    def wait(self) -> Outcome:
        """Wait for torchrun to exit, ending hung ranks on the way."""
        assert self._proc is not None, "use Job as a context manager"
        while self._proc.poll() is None:
            self._end_hung_ranks()
            time.sleep(POLL_S)
        return Outcome(
            self._proc.returncode, dict(self.hung), read_beats(self.report), self._tail()
        )

    def end(self) -> None:
        """End every process of the job that is still alive (see the module docstring)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(END_GRACE_S)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait()
        self.kill_now()  # ranks that outlived torchrun (it was killed, or they ignored SIGTERM)

    def kill_now(self) -> None:
        """SIGKILL to every process group of the job, without waiting."""
        if self._proc is not None:
            _kill_group(self._proc.pid, signal.SIGKILL)
        for beat in read_beats(self.report).values():
            if self._owns(beat.pid):
                _kill_group(beat.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ watching

    def _end_hung_ranks(self) -> None:
        beats, now = read_beats(self.report), time.time()
        for rank in range(self.nproc):
            beat = beats.get(rank)
            ended = self.hung.get(rank)
            if ended is not None and (
                beat is None or ended.beat is None or ended.beat.pid == beat.pid
            ):
                continue  # ended already (a restarted rank beats with a new pid)
            if beat is not None and _state_letter(beat.pid) in (None, "Z"):
                continue  # its process has exited
            silent = now - (beat.time if beat is not None else self._started)
            if silent <= (self.timeout_s if beat is not None else self.startup_s):
                continue
            state = _STATES.get(_state_letter(beat.pid) or "") if beat is not None else None
            self.hung[rank] = Hung(rank, beat, silent, state, at=now)
            if beat is not None and self._owns(beat.pid):
                _kill_group(beat.pid, signal.SIGKILL)  # torchrun sees it die, stops the rest
            else:  # it never started: nothing of it to kill but the whole job
                self.end()

    def _owns(self, pid: int) -> bool:
        """`pid` is alive and one of this job's ranks (its command line names our report)."""
        letter = _state_letter(pid)
        if letter in (None, "Z"):
            return False
        if not _HAS_PROC:
            return True
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return os.fsencode(self.report) in cmdline

    def _tail(self, limit: int = 4000) -> str:
        if not self.capture_output:
            return ""
        try:
            return (self.report / LOG).read_text(errors="replace")[-limit:]
        except OSError:
            return ""


def _state_letter(pid: int) -> str | None:
    """The process state letter of `pid` (`R`, `S`, `T`, `Z`, ...), None if there is none.
    Without /proc: `S` for any live process."""
    if _HAS_PROC:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        return text.rsplit(")", 1)[-1].split()[0]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "S"


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
