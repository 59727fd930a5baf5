"""Per-step records as JSON lines, read back within bounds, and the terminal progress bar.

`MetricsLog` appends one JSON object per line and flushes each line, so a job killed at any
moment leaves every finished step's line and at most one torn last line. Opening a log repairs
that: a torn last line is dropped (rewritten atomically: a temporary file renamed over the
log), and `resume_after=k` also drops the lines of steps after `k` (steps a crashed job ran past
its last checkpoint, which the resumed job runs again). Non-finite floats (a NaN loss) are
written as null: JSON has no NaN.

`read_jsonl` reads such a file from elsewhere: a regular file of at most `max_bytes`, each line
one JSON object (nesting bounded by `portable.limits`), a torn last line left out, and the
`NaN` / `Infinity` that Python's `json.dumps` writes for non-finite floats read as null.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, TextIO

from ..errors import JobError, PortableError
from ..safe_json import parse_json

__all__ = ["MAX_JSONL_BYTES", "MetricsLog", "ProgressBar", "read_jsonl"]

MAX_JSONL_BYTES = 256 << 20  # 256 MiB: about a million steps of metrics


class MetricsLog:
    """Append-only JSON lines, one object per line, flushed per line."""

    def __init__(self, path: str | os.PathLike, *, resume_after: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._repair(resume_after)
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def _repair(self, resume_after: int | None) -> None:
        with open(self.path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - 1, 0))
            torn = size > 0 and f.read(1) != b"\n"  # the last write was cut short
        if not torn and resume_after is None:
            return
        records = read_jsonl(self.path)
        if resume_after is not None:
            records = [r for r in records if _step(r) <= resume_after]
        lines = "".join(_line(r) for r in records)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(lines)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append `record` as one line (non-finite floats as null) and flush it."""
        if self._file is None:
            raise JobError(f"{self.path} was closed", fix="write records before close()")
        self._file.write(_line(record))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step(record: Mapping[str, Any]) -> float:
    """The record's step; a record without an int step sorts after every step (dropped)."""
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _line(record: Mapping[str, Any]) -> str:
    return json.dumps(_finite(dict(record)), allow_nan=False, separators=(",", ":")) + "\n"


def read_jsonl(
    path: str | os.PathLike,
    *,
    error: type[PortableError] = JobError,
    max_bytes: int = MAX_JSONL_BYTES,
) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file, in order (module docstring). `error` for a file that
    is not regular, is over `max_bytes`, or has a line (not the last) that is not an object."""
    path = Path(path)
    fix = f"{path.name} is written by portable train; re-run the job or remove the file"
    data = _read_bounded(path, error, max_bytes, fix)
    lines = data.split(b"\n")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        last = number == len(lines)  # no newline after it: a write that was cut short
        try:
            record = _parse_line(line, f"{path}:{number}", error, fix)
        except PortableError:
            if last:
                break
            raise
        if not isinstance(record, dict):
            if last:
                break
            raise error(f"{path}:{number} is a {type(record).__name__}, not an object", fix=fix)
        records.append(record)
    return records


# the non-finite literals Python's json.dumps writes (not JSON), outside words and quotes
_NONFINITE = re.compile(rb'(?<![\w"])-?(?:NaN|Infinity)(?![\w"])')


def _parse_line(line: bytes, where: str, error: type[PortableError], fix: str) -> Any:
    """One line's JSON; a line only `NaN` / `Infinity` literals spoil reads them as null."""
    try:
        return parse_json(line, where, error, fix=fix)
    except PortableError:
        if not _NONFINITE.search(line):
            raise
    return parse_json(_NONFINITE.sub(b"null", line), where, error, fix=fix)


def _read_bounded(path: Path, error: type[PortableError], limit: int, fix: str) -> bytes:
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise error(f"{path} is not a regular file", fix=fix)
            data = f.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}", fix=fix) from exc
    if len(data) > limit:
        raise error(f"{path} is over {limit} bytes", fix=fix)
    return data


class ProgressBar:
    """One self-rewriting line on a terminal (stderr isatty), nothing otherwise.

    `update(step, loss=..., tokens_per_s=..., mfu=..., ...)` redraws at most 10 times a second
    (and always for the last step) with the step, a bar, the fields given and the ETA from the
    rate of the steps since `start`."""

    def __init__(
        self,
        total: int,
        *,
        start: int = 0,
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.total = max(int(total), 1)
        self.start = start
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self._began = time.perf_counter()
        self._last_draw = -math.inf
        self._width = 0

    def update(self, step: int, **fields: float | None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if step < self.total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        done = step - self.start
        if "eta" not in fields and done > 0:
            fields["eta"] = (now - self._began) / done * max(self.total - step, 0)
        text = self.line(step, fields)
        pad = " " * max(self._width - len(text), 0)
        self._width = len(text)
        self.stream.write("\r" + text + pad)
        self.stream.flush()

    def line(self, step: int, fields: Mapping[str, float | None]) -> str:
        """The text of the bar for `step` with `fields` (what `update` draws)."""
        filled = int(20 * min(max(step, 0), self.total) / self.total)
        parts = [f"step {step}/{self.total} [{'#' * filled}{'.' * (20 - filled)}]"]
        parts += [_field(name, value) for name, value in fields.items() if value is not None]
        return "  ".join(parts)

    def close(self) -> None:
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
        self._width = 0


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a file
        return False


def _field(name: str, value: float) -> str:
    if not math.isfinite(value):
        return f"{name} {value}"
    if name == "mfu":
        return f"mfu {100 * value:.1f}%"
    if name == "eta":
        return f"eta {_duration(value)}"
    if name == "lr":
        return f"lr {value:.2e}"
    if name in ("tokens_per_s", "tok/s"):
        return f"tok/s {_si(value)}"
    return f"{name} {value:.4g}"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"
