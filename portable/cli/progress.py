"""Stage lines on stderr and per-stage timings.

Each stage prints `[i/n] label ... 1.2s`. On a terminal the label appears when the stage starts
and the time when it ends; otherwise the whole line is printed when the stage ends, so logs get
one clean line per stage. Timings are recorded whether or not anything is printed.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.timings: dict[str, float] = {}  # stage key -> seconds, in order
        self._index = 0

    @contextlib.contextmanager
    def stage(self, key: str, label: str) -> Iterator[None]:
        """Time the block under `key`; print its line (`failed` if it raises)."""
        self._index += 1
        head = f"[{self._index}/{self.total}] {label} ..."
        live = self.enabled and self.stream.isatty()
        if live:
            self._write(head + " ")
        start = time.perf_counter()
        outcome = "failed after "
        try:
            yield
            outcome = ""
        finally:
            seconds = time.perf_counter() - start
            self.timings[key] = round(seconds, 4)
            if self.enabled:
                self._write(
                    f"{outcome}{seconds:.1f}s\n" if live else f"{head} {outcome}{seconds:.1f}s\n"
                )

    def note(self, text: str) -> None:
        """An indented detail line under the current stage (pass summaries, skipped targets)."""
        if self.enabled:
            self._write("".join(f"      {line}\n" for line in text.splitlines()))

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
