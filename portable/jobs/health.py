"""Health checks of a training step: a non-finite loss or gradient norm, or a loss spike.

`Health.check` returns what is wrong with a step (None when it is healthy) and `action` the
policy's answer (`stop`, `skip`, `rollback`; config.HealthPolicy). A spike is a loss above
`spike_factor` times the mean of the last `spike_window` healthy losses (once that many have
been seen). With float16 loss scaling a non-finite gradient norm is not a problem: the program
itself skips that step and backs the scale off (GradScaler's rule).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping

from .config import HealthPolicy

__all__ = ["Health"]


class Health:
    def __init__(self, policy: HealthPolicy) -> None:
        self.policy = policy
        self.recent: collections.deque[float] = collections.deque(maxlen=policy.spike_window)
        self.rollbacks = 0
        self._last = "nonfinite"

    @property
    def needs_snapshot(self) -> bool:
        """Whether the loop must keep the state before each step (the `skip` action)."""
        actions = {self.policy.on_nonfinite}
        if self.policy.spike_factor is not None:
            actions.add(self.policy.on_spike)
        return "skip" in actions

    def check(self, step: int, loss: float, metrics: Mapping[str, float]) -> str | None:
        """What is wrong with step `step` (None: healthy; its loss joins the window)."""
        if not math.isfinite(loss):
            self._last = "nonfinite"
            return f"the loss is {loss}"
        norm = metrics.get("grad_norm")
        scaled = "loss_scale" in metrics
        if norm is not None and not math.isfinite(norm) and not scaled:
            self._last = "nonfinite"
            return f"the gradient norm is {norm}"
        factor = self.policy.spike_factor
        if factor is not None and len(self.recent) == self.recent.maxlen:
            mean = sum(self.recent) / len(self.recent)
            if loss > factor * mean:
                self._last = "spike"
                return (
                    f"the loss {loss:.6g} is {loss / mean:.3g}x the mean {mean:.6g} of the last "
                    f"{len(self.recent)} steps (spike factor {factor:g})"
                )
        self.recent.append(loss)
        return None

    def action(self, verdict: str) -> str:
        """The policy's action for the problem `check` just reported."""
        action = self.policy.on_spike if self._last == "spike" else self.policy.on_nonfinite
        if action == "rollback":
            self.rollbacks += 1
        return action
