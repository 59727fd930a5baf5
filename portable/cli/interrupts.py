"""Ctrl-C (SIGINT) and SIGTERM in the `portable` command: stop promptly, exit 128 + signal.

`handling_interrupts(announce)` wraps every command (app.py). For its duration:

- a signal raises `Interrupted` (a KeyboardInterrupt) in the main thread, so `finally` blocks and
  context managers undo what the command did (staging directories are deleted, child processes
  killed) and app.py prints one `error:` line;
- an interrupt that lands in a garbage-collector callback or a `__del__` is swallowed by Python
  (`Exception ignored in ...`) and the command would run on to the end: JAX registers such a
  callback (`_xla_gc_callback`), which runs on every collection once a backend imported JAX. The
  unraisable hook sees it and raises it again in the main thread;
- a watchdog thread, woken by the signal itself (`signal.set_wakeup_fd`, so even while the main
  thread is inside native code), ends the process when the command has not unwound `GRACE_S`
  seconds after the first signal, or at a second one: the `abandon_on_stop` callbacks run
  (staging directories are deleted), `announce` writes its lines, then `os._exit(128 + signal)`.

`deferred()` marks a critical section (the swap of an output into place): a signal that arrives
in it takes effect when it ends, and the watchdog never stops the process inside it.
Outside `handling_interrupts` (library use, worker processes) both helpers do nothing.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["GRACE_S", "Interrupted", "abandon_on_stop", "deferred", "handling_interrupts"]

GRACE_S = 3.0  # seconds a command has to unwind after the first signal
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_DONE, _WAKE = 0, 255  # bytes on the wakeup socket that are not signal numbers
_RETRY_S = 0.02  # how soon a swallowed interrupt is raised again
Announce = Callable[[int], tuple[str, str | None]]  # signum -> (stderr text, stdout text or None)


class Interrupted(KeyboardInterrupt):
    """The command was stopped by signal `signum` (SIGINT for Ctrl-C, or SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Session:
    """The signal state of one command (one at a time: signals are per process)."""

    def __init__(self, announce: Announce, wakeup_writer: socket.socket) -> None:
        self.announce = announce
        self.wakeup_writer = wakeup_writer
        self.first: int | None = None  # the first signal received
        self.raised = 0  # Interrupted raised so far
        self.swallowed = 0  # ... of which Python swallowed (the unraisable hook saw them)
        self.in_hook = False  # the unraisable hook is running (the handler must not raise)
        self.echoes = 0  # wakeup bytes of re-deliveries, which are not new signals
        self.deferring = 0
        self.pending: int | None = None  # a signal received inside a deferred section
        self.critical = threading.RLock()  # held through deferred sections
        self.abandon: dict[int, Callable[[], None]] = {}
        self.lock = threading.Lock()

    # main thread ----------------------------------------------------------------------------

    @property
    def redeliver(self) -> bool:
        """Every Interrupted raised so far was swallowed: one must be raised again."""
        return self.first is not None and self.swallowed >= self.raised

    def interrupted(self) -> Interrupted:
        self.raised += 1
        return Interrupted(self.first or signal.SIGINT)

    def on_signal(self, signum: int, frame: Any) -> None:
        if self.first is None:
            self.first = signum
            if self.deferring:
                self.pending = signum
                return
            raise self.interrupted()
        if self.redeliver and not self.in_hook and not self.deferring:
            raise self.interrupted()  # (in the hook it would be swallowed again: retried soon)
        # else: one is on its way up, or this is a second signal, which the watchdog handles

    def on_unraisable(self, unraisable: Any, previous: Callable[[Any], None]) -> None:
        if not isinstance(unraisable.exc_value, Interrupted) or self.first is None:
            previous(unraisable)
            return
        # raised again by the watchdog thread, until it lands in code that lets it propagate
        self.in_hook = True
        try:
            self.swallowed += 1
            with contextlib.suppress(OSError):
                self.wakeup_writer.send(bytes([_WAKE]))
        finally:
            self.in_hook = False

    # watchdog thread ------------------------------------------------------------------------

    def watch(self, wakeup: socket.socket) -> None:
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self.redeliver:
                timeout = _RETRY_S if timeout is None else min(timeout, _RETRY_S)
            ready, _, _ = select.select([wakeup], [], [], timeout)
            received = wakeup.recv(64) if ready else b""
            if _DONE in received:  # handling_interrupts is over
                return
            for number in received:
                if number == _WAKE or self._echo():
                    continue
                if deadline is not None:
                    self.stop_now(number)  # a second signal
                deadline = time.monotonic() + GRACE_S
            if deadline is not None and time.monotonic() >= deadline:
                self.stop_now(self.first or signal.SIGINT)  # the command did not unwind
            if self.redeliver:
                with self.lock:
                    self.echoes += 1  # interrupt_main writes the signal's byte too
                _thread.interrupt_main(signal.Signals(self.first or signal.SIGINT))

    def _echo(self) -> bool:
        with self.lock:
            echo = self.echoes > 0
            self.echoes -= echo
        return echo

    def stop_now(self, signum: int) -> None:
        self.critical.acquire(timeout=GRACE_S)  # never between the renames of a swap
        for undo in list(self.abandon.values()):
            with contextlib.suppress(Exception):
                undo()
        err, out = self.announce(signum)
        with contextlib.suppress(OSError):
            if out is not None:
                os.write(1, out.encode())
            os.write(2, err.encode())
        os._exit(128 + signum)


_ACTIVE: list[_Session] = []  # the session of the running command, if any


@contextlib.contextmanager
def handling_interrupts(announce: Announce) -> Iterator[None]:
    """Install the handlers for the block (main thread only; elsewhere it does nothing)."""
    if threading.current_thread() is not threading.main_thread() or _ACTIVE:
        yield
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    session = _Session(announce, writer)
    previous = {s: signal.signal(s, session.on_signal) for s in SIGNALS}
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: session.on_unraisable(u, old_hook)
    watchdog = threading.Thread(target=session.watch, args=(reader,), daemon=True)
    watchdog.start()
    _ACTIVE.append(session)
    try:
        yield
    finally:
        session.raised = session.swallowed + 1  # nothing is raised again from here on
        writer.send(bytes([_DONE]))  # the watchdog first: it must not interrupt what follows
        watchdog.join(timeout=1.0)
        _ACTIVE.remove(session)
        signal.set_wakeup_fd(old_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = old_hook
        reader.close()
        writer.close()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A critical section: a signal received inside it is acted on when it ends."""
    session = _ACTIVE[0] if _ACTIVE else None
    if session is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if session.first is not None:  # interrupted already (a swallowed interrupt not re-raised)
        raise session.interrupted()
    with session.critical:
        session.deferring += 1
        try:
            yield
        finally:
            session.deferring -= 1
    if session.pending is not None and not session.deferring:
        session.pending = None
        raise session.interrupted()


@contextlib.contextmanager
def abandon_on_stop(undo: Callable[[], None]) -> Iterator[None]:
    """Run `undo` if the watchdog ends the process during the block (normal unwinding does not
    reach `finally` blocks then)."""
    session = _ACTIVE[0] if _ACTIVE else None
    if session is None:
        yield
        return
    key = id(undo)
    session.abandon[key] = undo
    try:
        yield
    finally:
        session.abandon.pop(key, None)
