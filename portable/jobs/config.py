"""`JobConfig`: everything a training job is told, as data.

The launcher writes it to `RUN/.job/job.json`; every rank reads it back from there (untrusted
input: `JobConfig.from_json` checks each field's type and range, nothing is evaluated). The same
object is built from `portable train`'s flags and from `portable.train(...)`'s arguments.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import JobError

__all__ = ["ENGINES", "HEALTH_ACTIONS", "HealthPolicy", "JobConfig"]

ENGINES = ("cpu", "xla", "cuda", "neuron")
HEALTH_ACTIONS = ("stop", "skip", "rollback")


@dataclasses.dataclass(frozen=True)
class HealthPolicy:
    """What a job does when a step is unhealthy: a non-finite loss or gradient norm, or a loss
    above `spike_factor` times the mean of the last `spike_window` healthy losses.

    Actions: `stop` (end the job with a JobError naming the step and the value), `skip` (drop the
    step's update: state restored to before it, the data cursor still advances), `rollback`
    (reload the last checkpoint and go on from there, skipping the batches that failed; at most
    `max_rollbacks` times)."""

    on_nonfinite: str = "stop"
    on_spike: str = "stop"
    spike_factor: float | None = None  # None: no spike check
    spike_window: int = 20
    max_rollbacks: int = 3

    def __post_init__(self) -> None:
        for name in ("on_nonfinite", "on_spike"):
            if getattr(self, name) not in HEALTH_ACTIONS:
                raise JobError(
                    f"{name}={getattr(self, name)!r} is not a health action",
                    fix=f"use one of {', '.join(HEALTH_ACTIONS)}",
                )
        if self.spike_factor is not None and not (
            math.isfinite(self.spike_factor) and self.spike_factor > 1
        ):
            raise JobError(
                f"spike_factor={self.spike_factor} must be a finite number above 1",
                fix="pass e.g. --spike-factor 3 (a loss 3x the recent mean is a spike)",
            )
        _positive(self.spike_window, "spike_window")
        _non_negative(self.max_rollbacks, "max_rollbacks")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """One training job (see docs/training-jobs.md for each field's flag)."""

    spec: str  # file.py:Name, pkg.module:Name, or a training-step archive
    data: str  # token file (.bin / .npy) or a saved Hugging Face dataset directory
    steps: int
    out: str  # RUN directory
    plan: str | None = None  # plan.json or file.py:attr; default: the spec's own plan
    nproc: int = 1
    engine: str = "cpu"
    ckpt_every: int | None = None
    ckpt_async: bool = False
    keep: int | None = None  # keep the last K complete checkpoints (None: all)
    resume: bool = False
    resume_from: str | None = None  # a checkpoint (step-<N>/) or another RUN (its latest)
    seed: int = 0  # data order and the dropout generator's key
    data_dtype: str | None = None  # uint16 (default for .bin) or uint32
    batch: int | None = None  # global batch (default: the spec's example batch)
    seq: int | None = None  # tokens per sample (default: the spec's example batch)
    eval_data: str | None = None
    eval_every: int | None = None
    eval_batches: int = 4
    target_loss: float | None = None
    price_per_hour: float | None = None
    init_from: str | None = None  # a Hugging Face save_pretrained directory
    trace_steps: tuple[int, ...] = ()
    health: HealthPolicy = dataclasses.field(default_factory=HealthPolicy)
    timeout_s: float = 300.0  # a rank silent this long (stopped, wedged) is ended
    max_restarts: int = 0  # torchrun's elastic restarts
    prefetch: int = 2  # batches loaded ahead of the step

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise JobError(
                f"engine {self.engine!r} is not one of {', '.join(ENGINES)}",
                fix="pass --engine cpu|xla|cuda|neuron",
            )
        _positive(self.steps, "steps")
        _positive(self.nproc, "nproc")
        _positive(self.eval_batches, "eval_batches")
        _positive(self.prefetch, "prefetch")
        _non_negative(self.max_restarts, "max_restarts")
        for name in ("ckpt_every", "keep", "batch", "seq", "eval_every"):
            if getattr(self, name) is not None:
                _positive(getattr(self, name), name)
        if self.eval_every is not None and self.eval_data is None:
            raise JobError("--eval-every needs --eval-data", fix="pass --eval-data FILE")
        if self.data_dtype not in (None, "uint16", "uint32"):
            raise JobError(
                f"data dtype {self.data_dtype!r} is not uint16 or uint32",
                fix="pass --dtype uint16 or --dtype uint32",
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise JobError(f"timeout {self.timeout_s} must be positive", fix="pass --timeout S")
        for name in ("target_loss", "price_per_hour"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise JobError(f"{name}={value} must be a positive number")
        if any(s < 1 for s in self.trace_steps):
            raise JobError(f"trace steps {list(self.trace_steps)} must be at least 1")

    @property
    def eval_every_steps(self) -> int | None:
        """How often eval runs: --eval-every, else every checkpoint, else at the end only."""
        if self.eval_data is None:
            return None
        return self.eval_every or self.ckpt_every or self.steps

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["trace_steps"] = list(self.trace_steps)
        return doc

    @staticmethod
    def from_json(doc: Any) -> JobConfig:
        """A config read back from job.json (JobError on anything malformed)."""
        if not isinstance(doc, dict):
            raise JobError("job.json is not an object", fix="re-run portable train")
        fields = {f.name: f for f in dataclasses.fields(JobConfig)}
        unknown = sorted(set(doc) - set(fields))
        if unknown:
            raise JobError(f"job.json has unknown fields {unknown}", fix="re-run portable train")
        values: dict[str, Any] = {}
        for name, value in doc.items():
            if name == "health":
                values[name] = _health(value)
            elif name == "trace_steps":
                values[name] = tuple(_typed(v, int, name) for v in _typed(value, list, name))
            else:
                values[name] = _field_value(name, value, fields[name].default)
        return JobConfig(**values)


def _health(value: Any) -> HealthPolicy:
    if not isinstance(value, dict):
        raise JobError("job.json: health is not an object", fix="re-run portable train")
    allowed = {f.name for f in dataclasses.fields(HealthPolicy)}
    if set(value) - allowed:
        raise JobError(f"job.json: unknown health fields {sorted(set(value) - allowed)}")
    return HealthPolicy(**value)


_TYPES: dict[str, type | tuple[type, ...]] = {
    "spec": str,
    "data": str,
    "out": str,
    "steps": int,
    "nproc": int,
    "engine": str,
    "ckpt_async": bool,
    "resume": bool,
    "seed": int,
    "eval_batches": int,
    "timeout_s": (int, float),
    "max_restarts": int,
    "prefetch": int,
}


def _field_value(name: str, value: Any, default: Any) -> Any:
    if value is None:
        if name in _TYPES:
            raise JobError(f"job.json: {name} must not be null", fix="re-run portable train")
        return None
    want = _TYPES.get(name)
    if want is None:  # optional fields: the type of a present value
        want = (int, float) if name in ("target_loss", "price_per_hour") else None
        if want is None:
            want = (
                str
                if name in ("plan", "eval_data", "init_from", "data_dtype", "resume_from")
                else int
            )
    return _typed(value, want, name)


def _typed(value: Any, want: type | tuple[type, ...], name: str) -> Any:
    if isinstance(value, bool) and want is not bool and bool not in _as_tuple(want):
        raise JobError(f"job.json: {name} is a boolean", fix="re-run portable train")
    if not isinstance(value, want):
        raise JobError(f"job.json: {name} is a {type(value).__name__}", fix="re-run portable train")
    return value


def _as_tuple(want: type | tuple[type, ...]) -> tuple[type, ...]:
    return want if isinstance(want, tuple) else (want,)


def _positive(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobError(f"{name} must be a positive integer, got {value!r}")


def _non_negative(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JobError(f"{name} must be a non-negative integer, got {value!r}")
