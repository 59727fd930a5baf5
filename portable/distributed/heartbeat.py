"""A rank's heartbeat: where it is in the run, written while its process is alive.

Each rank of `portable run` writes `REPORT/rank<r>.beat.json` from a daemon thread every
`interval` seconds and whenever it moves on (atomically, temp file + rename):

    {"rank": 1, "pid": 4242, "phase": "step", "step": 3, "steps": 5, "time": 1765432100.5}

`time` is when the file was written (time.time()). A process that is stopped (SIGSTOP, Ctrl-Z)
or wedged without releasing the interpreter stops beating; the launcher (job.py) ends the job when
a beat is older than its timeout, and the message names the phase and step last reached.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

__all__ = ["PHASES", "Beat", "Heartbeat", "read_beats"]

PHASES = {  # phase -> how a message says it (a training step adds its number)
    "start": "loading the per-rank program",
    "init": "joining the process group",
    "shard": "sharding the state and inputs",
    "step": "training step",
    "inference": "the inference call",
    "gather": "gathering the results on rank 0",
    "write": "writing the results",
    "done": "finishing",
}


@dataclasses.dataclass(frozen=True)
class Beat:
    """One rank's last heartbeat."""

    rank: int
    pid: int
    phase: str
    time: float
    step: int | None = None
    steps: int | None = None

    def where(self) -> str:
        """`training step 3 of 5`, `joining the process group`, ..."""
        text = PHASES.get(self.phase, self.phase)
        if self.phase == "step" and self.step is not None:
            text += f" {self.step} of {self.steps}"
        return text


class Heartbeat:
    """The beating thread of this rank (`at` moves it on; `stop` ends it)."""

    def __init__(self, folder: Path, rank: int, interval: float) -> None:
        self._path = folder / f"rank{rank}.beat.json"
        self._tmp = folder / f".rank{rank}.beat.json.tmp"
        self._state = {"rank": rank, "pid": os.getpid(), "phase": "start"}
        self._interval = interval
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="portable-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._write()
        self._thread.start()
        return self

    def at(self, phase: str, step: int | None = None, steps: int | None = None) -> None:
        """This rank now is in `phase` (a training step: `step` of `steps`)."""
        with self._lock:
            self._state.update(phase=phase, step=step, steps=steps)
        self._write()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            self._write()

    def _write(self) -> None:
        with self._lock:
            doc = {**self._state, "time": time.time()}
            try:
                self._tmp.write_text(json.dumps(doc))
                self._tmp.replace(self._path)
            except OSError:  # the launcher removed the folder: the job is over
                self._stopped.set()


def read_beats(folder: Path) -> dict[int, Beat]:
    """Every rank's last heartbeat in `folder`, by rank (unreadable files are skipped)."""
    beats = {}
    for path in folder.glob("rank*.beat.json"):
        try:
            doc = json.loads(path.read_text())
            beat = Beat(**{f.name: doc.get(f.name) for f in dataclasses.fields(Beat)})
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        if not (isinstance(beat.rank, int) and isinstance(beat.pid, int)):
            continue
        beats[beat.rank] = beat
    return beats
