"""The processes of a job die with the process that started them.

`die_with_parent(parent)` asks the kernel (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`) to kill this
process when its parent ends, however it ends (kill -9 included; a stopped process is killed
too). `portable run`'s torchrun and its ranks call it first thing, so killing the launcher ends
the whole job. Elsewhere it does nothing: the launcher's own cleanup (job.py) is then all there is.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None) -> None:
    """Be killed when `parent` ends; end now if it already has (we were reparented)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)  # the parent died before the request took effect
