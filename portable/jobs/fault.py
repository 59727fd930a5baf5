"""Fault injection for `portable drill`: a rank kills or stops itself at the start of a step.

The drill sets PORTABLE_DRILL_FAULT="RANK@STEP:SIGNAL" (SIGNAL is KILL or STOP) for the job;
the fault fires once, in the first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT = 0), so
the restarted job runs through. Before it fires, the rank writes RUN/drill/fault.json with the
time, which is where the drill's recovery clock starts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from ..errors import JobError

__all__ = ["FAULT_ENV", "Fault", "maybe_fire", "parse_fault"]

FAULT_ENV = "PORTABLE_DRILL_FAULT"
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


class Fault:
    def __init__(self, rank: int, step: int, signal_name: str) -> None:
        self.rank, self.step, self.signal_name = rank, step, signal_name

    def __str__(self) -> str:
        return f"{self.rank}@{self.step}:{self.signal_name}"


def parse_fault(text: str, signal_name: str = "KILL") -> Fault:
    """`RANK@STEP` (as --kill takes it) or `RANK@STEP:SIGNAL`."""
    head, _, sig = text.partition(":")
    sig = (sig or signal_name).upper().removeprefix("SIG")
    rank, at, step = head.partition("@")
    if not at or not rank.isdigit() or not step.isdigit() or sig not in SIGNALS:
        raise JobError(
            f"cannot read the fault {text!r}",
            fix="pass --kill RANK@STEP (e.g. --kill 1@120) and --signal KILL or STOP",
        )
    if int(step) < 1:
        raise JobError(f"the fault's step must be at least 1, got {step}")
    return Fault(int(rank), int(step), sig)


def maybe_fire(rank: int, step: int, restart: int, run: Path) -> None:
    """Kill or stop this process if the drill's fault is for this rank at this step."""
    text = os.environ.get(FAULT_ENV)
    if not text or restart != 0:
        return
    fault = parse_fault(text)
    if fault.rank != rank or fault.step != step:
        return
    folder = run / "drill"
    folder.mkdir(exist_ok=True)
    doc = {"rank": rank, "step": step, "signal": fault.signal_name, "pid": os.getpid()}
    doc["time"] = time.time()
    (folder / "fault.json").write_text(json.dumps(doc) + "\n")
    os.kill(os.getpid(), SIGNALS[fault.signal_name])
