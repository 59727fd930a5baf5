"""Traces of chosen steps in the Chrome trace format (what torch.profiler exports), so
chrome://tracing, Perfetto (ui.perfetto.dev) and TensorBoard's profile viewer open them.

`StepTracer` runs torch.profiler around the chosen steps of an engine that executes through
PyTorch (cpu, cuda: CUDA activity too when a GPU is there) and writes
`RUN/traces/rank<r>-step<k>.json`. Engines without torch.profiler (XLA) write their own timed
spans with `write_chrome_trace`. Both write atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ..errors import JobError

__all__ = ["StepTracer", "trace_path", "write_chrome_trace"]


def trace_path(out_dir: str | os.PathLike, rank: int, step: int) -> Path:
    """Where the trace of `step` on `rank` goes."""
    return Path(out_dir) / f"rank{rank}-step{step}.json"


class StepTracer:
    """torch.profiler around chosen steps; writes RUN/traces/rank<r>-step<k>.json (Chrome trace)."""

    def __init__(self, out_dir: str | os.PathLike, rank: int, steps: Collection[int]) -> None:
        self.out_dir = Path(out_dir)
        self.rank = rank
        self.steps = frozenset(steps)
        self.written: list[Path] = []

    def step(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Profile the block when `step` is a chosen one (else do nothing); its trace is
        written when the block finishes without raising."""
        if step not in self.steps:
            return contextlib.nullcontext()
        return self._profiled(step)

    def close(self) -> None:
        """Nothing stays open between steps: each trace is written as its step ends."""

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities, record_shapes=True) as prof:
            with record_function(f"step {step}"):
                yield
        path = trace_path(self.out_dir, self.rank, step)
        _atomic(path, prof.export_chrome_trace)
        self.written.append(path)


def write_chrome_trace(
    path: str | os.PathLike, events: Sequence[Mapping[str, Any]], *, pid: int = 0
) -> None:
    """Write complete ("X") events `{name, ts_us, dur_us, tid[, args]}` as a Chrome trace."""
    trace = [_event(e, i, pid) for i, e in enumerate(events)]
    doc = {"traceEvents": trace, "displayTimeUnit": "ms"}

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, allow_nan=False)

    _atomic(Path(path), write)


def _event(event: Mapping[str, Any], index: int, pid: int) -> dict[str, Any]:
    name, ts, dur, tid = (event.get(k) for k in ("name", "ts_us", "dur_us", "tid"))
    numbers = (ts, dur)
    if (
        not isinstance(name, str)
        or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers)
        or not isinstance(tid, int)
        or (isinstance(dur, (int, float)) and dur < 0)
    ):
        raise JobError(
            f"trace event {index} is not {{name: str, ts_us: number, dur_us: number >= 0, "
            f"tid: int}}: {dict(event)!r:.200}",
            fix="pass complete events with a name, start and duration in microseconds",
        )
    out: dict[str, Any] = {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if "args" in event:
        out["args"] = dict(event["args"])
    return out


def _atomic(path: Path, write: Callable[[str], object]) -> None:
    """`write(tmp_path)` then rename it to `path`; nothing is left behind if it fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
