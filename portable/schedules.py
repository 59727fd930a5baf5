"""Learning-rate schedules as program data, traced into a training step.

A schedule is a frozen dataclass of hyper-parameters and one function, `lr(step, base_lr)`: the
learning rate at scheduler epoch `step` of a parameter group whose base (initial) lr is
`base_lr`. Epoch 0 is the first optimizer step, i.e. what torch's `scheduler.last_epoch` is when
`optimizer.step()` runs. `lr` is plain elementwise torch ops in float64 (`where`, `clamp`, `cos`,
`pow`, ...; no Python branching on values, no `.item()`), so `make_fx` traces it into a graph
over the opset. Schedules round-trip through `to_dict` / `from_dict`, which reads archives as
hostile input.

The formulas (t = step, b = base_lr, m = min_lr, p(t, n) = min(t, n) / n; every min_lr is an
absolute learning rate shared by all groups, as torch's `eta_min`):

    Constant(factor, steps)             b * factor while t < steps (always if steps is None), then b
    Linear(start_factor, end_factor, steps)  b * (s + (e - s) * p(t, steps))       (torch LinearLR)
    LinearWarmup(steps, start_factor)   Linear(start_factor, 1, steps): b from t = steps on
    Cosine(steps, min_lr, periodic)     m + (b - m) * (1 + cos(pi * u / steps)) / 2, u = min(t, steps),
                                        or u = t if periodic (torch CosineAnnealingLR's continuation)
    LinearDecay(steps, min_lr)          m + (b - m) * (1 - p(t, steps))
    Polynomial(steps, power, min_lr)    m + (b - m) * (1 - p(t, steps)) ** power     (torch PolynomialLR)
    StepDecay(step_size, gamma)         b * gamma ** floor(t / step_size)           (torch StepLR)
    MultiStepDecay(milestones, gamma)   b * gamma ** #{i : milestones[i] <= t}      (torch MultiStepLR)
    ExponentialDecay(gamma)             b * gamma ** t                              (torch ExponentialLR)
    InverseSqrt(warmup, start_factor)   LinearWarmup(warmup, start_factor) for t < warmup, then
                                        b * sqrt(warmup / t)                 (fairseq's inverse_sqrt)
    WSD(warmup, stable, decay, min_lr, decay_shape, start_factor)
                                        t < warmup:           LinearWarmup(warmup, start_factor)
                                        t < warmup + stable:  b
                                        later:                m + (b - m) * f(q), q = p(t - warmup - stable, decay)
                                        f(q) = 1 - q ("linear"), (1 + cos(pi q)) / 2 ("cosine"), 1 - sqrt(q) ("sqrt");
                                        m from t = warmup + stable + decay on (torchtitan's shapes)
    Sequence(schedules, milestones)     schedules[i] at t - milestones[i - 1] while
                                        milestones[i - 1] <= t < milestones[i]         (torch SequentialLR)

`from_torch(scheduler)` converts a torch scheduler to the schedule that gives its
`get_last_lr()` sequence (the closed forms above equal torch's recursive updates to about 1e-12
relative) and its start, the scheduler's `last_epoch` at capture; `as_schedule` accepts
either. What a program cannot reproduce (a Python lambda, a metric-driven schedule) is refused
with the schedule to use instead.
"""

from __future__ import annotations

import abc
import bisect
import collections
import dataclasses
import math
import reprlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch.optim import lr_scheduler as torch_sched

from .errors import ArchiveError, CaptureError, PortableError

__all__ = [
    "WSD",
    "Constant",
    "Cosine",
    "ExponentialDecay",
    "InverseSqrt",
    "Linear",
    "LinearDecay",
    "LinearWarmup",
    "MultiStepDecay",
    "Polynomial",
    "Schedule",
    "Sequence",
    "StepDecay",
    "as_schedule",
    "from_torch",
]

MAX_STEPS = 2**53  # every epoch up to here is an exact float64
MAX_PARTS = 64  # schedules in one Sequence
MAX_MILESTONES = 1024  # milestones of one MultiStepDecay or Sequence
MAX_DEPTH = 8  # Sequence inside Sequence
MAX_SIZE = 4096  # schedules plus milestones in one schedule, nested ones included

_F64 = torch.float64
_ARCHIVE_FIX = (
    "the archive's training schedule is corrupted or from a newer portable; re-capture it"
)
ErrorType = type[PortableError]


# ------------------------------------------------------------------------ field rules


@dataclasses.dataclass(frozen=True)
class _Int:
    """An int (never a bool) in [low, MAX_STEPS]; None too when `optional`."""

    low: int
    optional: bool = False

    def check(self, value: Any, where: str, error: ErrorType) -> int | None:
        if value is None and self.optional:
            return None
        return _epoch(value, self.low, where, error, " or null" if self.optional else "")


def _epoch(value: Any, low: int, where: str, error: ErrorType, also: str = "") -> int:
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_STEPS:
        return value
    raise _bad(where, f"an int in [{low}, 2**53]{also}", value, error)


@dataclasses.dataclass(frozen=True)
class _Float:
    """A finite real (an int is accepted and stored as a float) in [low, high]."""

    low: float = 0.0
    high: float = 1e300

    def check(self, value: Any, where: str, error: ErrorType) -> float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value) and self.low <= value <= self.high:
                return float(value)
        raise _bad(where, f"a finite number in [{self.low:g}, {self.high:g}]", value, error)


@dataclasses.dataclass(frozen=True)
class _Choice:
    options: tuple[str, ...]

    def check(self, value: Any, where: str, error: ErrorType) -> str:
        if isinstance(value, str) and value in self.options:
            return value
        raise _bad(where, "one of " + ", ".join(map(repr, self.options)), value, error)


@dataclasses.dataclass(frozen=True)
class _Bool:
    def check(self, value: Any, where: str, error: ErrorType) -> bool:
        if isinstance(value, bool):
            return value
        raise _bad(where, "true or false", value, error)


@dataclasses.dataclass(frozen=True)
class _Milestones:
    """Non-decreasing epochs, at most MAX_MILESTONES of them (a list or tuple; stored as a tuple)."""

    def check(self, value: Any, where: str, error: ErrorType) -> tuple[int, ...]:
        if not isinstance(value, list | tuple) or len(value) > MAX_MILESTONES:
            raise _bad(where, f"a list of at most {MAX_MILESTONES} epochs", value, error)
        out = tuple(_epoch(v, 0, f"{where}[{i}]", error) for i, v in enumerate(value))
        if any(b < a for a, b in zip(out, out[1:], strict=False)):
            raise error(f"{where} must be non-decreasing, got {_show(list(out))}", fix=_fix(error))
        return out


@dataclasses.dataclass(frozen=True)
class _Parts:
    """1 to MAX_PARTS schedules (a list or tuple of Schedule objects; stored as a tuple)."""

    def check(self, value: Any, where: str, error: ErrorType) -> tuple[Schedule, ...]:
        if not isinstance(value, list | tuple) or not 1 <= len(value) <= MAX_PARTS:
            raise _bad(where, f"a list of 1 to {MAX_PARTS} schedules", value, error)
        for i, part in enumerate(value):
            if not isinstance(part, Schedule):
                raise _bad(f"{where}[{i}]", "a portable.schedules.Schedule", part, error)
        return tuple(value)


_Rule = _Int | _Float | _Choice | _Bool | _Milestones | _Parts


def _bad(where: str, wanted: str, value: Any, error: ErrorType) -> PortableError:
    return error(
        f"{where} must be {wanted}, got {_show(value)} ({type(value).__name__})", fix=_fix(error)
    )


def _show(value: Any) -> str:
    # a value from a file, shown short: a huge int has no repr (str digit limit), a huge list
    # would print whole
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit int>"
    return reprlib.repr(value)


def _fix(error: ErrorType, python_fix: str = "") -> str:
    """The fix for bad schedule data: re-capture for an archive, else `python_fix`."""
    if error is ArchiveError:
        return _ARCHIVE_FIX
    return python_fix or "pass hyper-parameters in the range the schedule's docstring gives"


def _field(rule: _Rule, default: Any = dataclasses.MISSING) -> Any:
    return dataclasses.field(default=default, metadata={"rule": rule})


# ------------------------------------------------------------------------ the base class


@dataclasses.dataclass(frozen=True)
class Schedule(abc.ABC):
    """Base: subclasses set `kind`, declare their fields with rules, and define `_lr` and
    `describe`. Fields are checked (types and ranges) on construction."""

    kind: ClassVar[str] = "schedule"

    def __post_init__(self) -> None:
        _check_fields(self, CaptureError)

    def lr(self, step: torch.Tensor, base_lr: float) -> torch.Tensor:
        """The float64 learning rate at epoch `step` (a float64 tensor of epochs, usually 0-d;
        elementwise) for a parameter group whose base lr is `base_lr`."""
        if not isinstance(step, torch.Tensor) or step.dtype != _F64:
            got = step.dtype if isinstance(step, torch.Tensor) else type(step).__name__
            raise CaptureError(
                f"{type(self).__name__}.lr takes the epoch as a float64 tensor, got {got}",
                fix="pass step.to(torch.float64) (a float32 step loses exactness past 2**24)",
            )
        base = _Float().check(base_lr, "base_lr", CaptureError)
        return self._lr(step, base)

    @abc.abstractmethod
    def _lr(self, t: torch.Tensor, base: float) -> torch.Tensor:
        """`lr` on a checked float64 `t` and base."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for `portable inspect`."""

    def _check_relations(self, error: ErrorType) -> None:
        """Checks across fields, after each field's own (none by default)."""
        return None

    @property
    def length(self) -> int | None:
        """The epoch from which the lr no longer changes, when there is one (for `describe`)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with "kind"; `from_dict` reads it back to an equal schedule."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(f.metadata["rule"], _Parts):
                value = [part.to_dict() for part in value]
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @staticmethod
    def from_dict(data: Any) -> Schedule:
        """The schedule `data` describes. `data` is untrusted (an archive): every field's type
        and range is checked, nesting and size are bounded, and any problem is an ArchiveError."""
        return _decode(data, "schedule", depth=0, budget=[MAX_SIZE])


def _check_fields(schedule: Schedule, error: ErrorType) -> None:
    for f in dataclasses.fields(schedule):
        where = f"{schedule.kind}.{f.name}"
        value = f.metadata["rule"].check(getattr(schedule, f.name), where, error)
        object.__setattr__(schedule, f.name, value)
    schedule._check_relations(error)


def _full(t: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full_like(t, value)


def _x(factor: float) -> str:
    return f"{factor:g}x"


# ------------------------------------------------------------------------ shared pieces


def _fraction(t: torch.Tensor, steps: int) -> torch.Tensor:
    # min(t, steps) / steps, clamped below at 0: exactly 0 at t <= 0 and 1 from t = steps on
    return t.clamp(0, steps) / steps


def _linear(t: torch.Tensor, steps: int, start: float, end: float, base: float) -> torch.Tensor:
    # b * (s + (e - s) * p(t, steps))
    return (start + (end - start) * _fraction(t, steps)) * base


def _anneal(shape: torch.Tensor, base: float, min_lr: float) -> torch.Tensor:
    # m + (b - m) * shape, shape falling from 1 to 0
    return min_lr + (base - min_lr) * shape


def _half_cosine(u: torch.Tensor, steps: int) -> torch.Tensor:
    # (1 + cos(pi * u / steps)) / 2, evaluated in torch CosineAnnealingLR's order
    return (1 + torch.cos(math.pi * u / steps)) / 2


_DECAY_SHAPES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "linear": lambda q: 1 - q,
    "cosine": lambda q: (1 + torch.cos(math.pi * q)) / 2,
    "sqrt": lambda q: 1 - torch.sqrt(q),
}


# ------------------------------------------------------------------------ schedules


@dataclasses.dataclass(frozen=True)
class Constant(Schedule):
    """b * factor while t < steps (for every t when steps is None), then b."""

    kind: ClassVar[str] = "constant"
    factor: float = _field(_Float(), 1.0)
    steps: int | None = _field(_Int(0, optional=True), None)

    def _lr(self, t, base):
        if self.steps is None:
            return _full(t, base * self.factor)
        return torch.where(t < self.steps, _full(t, base * self.factor), _full(t, base))

    def describe(self) -> str:
        if self.steps is None:
            return f"constant {_x(self.factor)}"
        return f"constant {_x(self.factor)} for {self.steps} steps, then 1x"

    @property
    def length(self) -> int | None:
        return 0 if self.steps is None else self.steps


@dataclasses.dataclass(frozen=True)
class Linear(Schedule):
    """b * (start_factor + (end_factor - start_factor) * min(t, steps) / steps)."""

    kind: ClassVar[str] = "linear"
    start_factor: float = _field(_Float())
    end_factor: float = _field(_Float())
    steps: int = _field(_Int(1))

    def _lr(self, t, base):
        return _linear(t, self.steps, self.start_factor, self.end_factor, base)

    def describe(self) -> str:
        return (
            f"linear from {_x(self.start_factor)} to {_x(self.end_factor)} over {self.steps} steps"
        )

    @property
    def length(self) -> int | None:
        return self.steps


@dataclasses.dataclass(frozen=True)
class LinearWarmup(Schedule):
    """b * (start_factor + (1 - start_factor) * min(t, steps) / steps): b from t = steps on."""

    kind: ClassVar[str] = "linear_warmup"
    steps: int = _field(_Int(1))
    start_factor: float = _field(_Float(), 0.0)

    def _lr(self, t, base):
        return _linear(t, self.steps, self.start_factor, 1.0, base)

    def describe(self) -> str:
        return f"linear warmup {self.steps} steps from {_x(self.start_factor)}"

    @property
    def length(self) -> int | None:
        return self.steps


@dataclasses.dataclass(frozen=True)
class Cosine(Schedule):
    """min_lr + (b - min_lr) * (1 + cos(pi * u / steps)) / 2 with u = min(t, steps): min_lr from
    t = steps on; with `periodic`, u = t: back up to b at 2 * steps and down again, as torch's
    CosineAnnealingLR continues past T_max."""

    kind: ClassVar[str] = "cosine"
    steps: int = _field(_Int(1))
    min_lr: float = _field(_Float(), 0.0)
    periodic: bool = _field(_Bool(), False)

    def _lr(self, t, base):
        u = t if self.periodic else t.clamp(max=self.steps)
        return _anneal(_half_cosine(u, self.steps), base, self.min_lr)

    def describe(self) -> str:
        tail = f", periodic (back to the base lr at step {2 * self.steps})" if self.periodic else ""
        return f"cosine to {self.min_lr:g} over {self.steps} steps{tail}"

    @property
    def length(self) -> int | None:
        return None if self.periodic else self.steps


@dataclasses.dataclass(frozen=True)
class LinearDecay(Schedule):
    """min_lr + (b - min_lr) * (1 - min(t, steps) / steps): min_lr from t = steps on."""

    kind: ClassVar[str] = "linear_decay"
    steps: int = _field(_Int(1))
    min_lr: float = _field(_Float(), 0.0)

    def _lr(self, t, base):
        return _anneal(1 - _fraction(t, self.steps), base, self.min_lr)

    def describe(self) -> str:
        return f"linear decay to {self.min_lr:g} over {self.steps} steps"

    @property
    def length(self) -> int | None:
        return self.steps


@dataclasses.dataclass(frozen=True)
class Polynomial(Schedule):
    """min_lr + (b - min_lr) * (1 - min(t, steps) / steps) ** power (torch PolynomialLR when
    min_lr is 0; Hugging Face's polynomial decay's lr_end otherwise)."""

    kind: ClassVar[str] = "polynomial"
    steps: int = _field(_Int(1))
    power: float = _field(_Float(0.0, 1e6), 1.0)
    min_lr: float = _field(_Float(), 0.0)

    def _lr(self, t, base):
        return _anneal((1 - _fraction(t, self.steps)) ** self.power, base, self.min_lr)

    def describe(self) -> str:
        return f"polynomial (power {self.power:g}) to {self.min_lr:g} over {self.steps} steps"

    @property
    def length(self) -> int | None:
        return self.steps


@dataclasses.dataclass(frozen=True)
class StepDecay(Schedule):
    """b * gamma ** floor(t / step_size)."""

    kind: ClassVar[str] = "step_decay"
    step_size: int = _field(_Int(1))
    gamma: float = _field(_Float(), 0.1)

    def _lr(self, t, base):
        return self.gamma ** torch.floor(t / self.step_size) * base

    def describe(self) -> str:
        return f"x{self.gamma:g} every {self.step_size} steps"


@dataclasses.dataclass(frozen=True)
class MultiStepDecay(Schedule):
    """b * gamma ** (the number of milestones <= t; a repeated milestone counts each time)."""

    kind: ClassVar[str] = "multistep_decay"
    milestones: tuple[int, ...] = _field(_Milestones())
    gamma: float = _field(_Float(), 0.1)

    def _lr(self, t, base):
        count = torch.zeros_like(t)
        for milestone, times in collections.Counter(self.milestones).items():
            count = count + (t >= milestone).to(_F64) * times
        return self.gamma**count * base

    def describe(self) -> str:
        shown = ", ".join(map(str, self.milestones[:8])) + (
            ", ..." if len(self.milestones) > 8 else ""
        )
        return f"x{self.gamma:g} at steps {shown}"

    @property
    def length(self) -> int | None:
        return self.milestones[-1] if self.milestones else 0


@dataclasses.dataclass(frozen=True)
class ExponentialDecay(Schedule):
    """b * gamma ** t."""

    kind: ClassVar[str] = "exponential_decay"
    gamma: float = _field(_Float())

    def _lr(self, t, base):
        return self.gamma**t * base

    def describe(self) -> str:
        return f"x{self.gamma:g} every step"


@dataclasses.dataclass(frozen=True)
class InverseSqrt(Schedule):
    """LinearWarmup(warmup, start_factor) for t < warmup, then b * sqrt(warmup / t) (fairseq's
    inverse_sqrt: b at t = warmup, b / 2 at t = 4 * warmup)."""

    kind: ClassVar[str] = "inverse_sqrt"
    warmup: int = _field(_Int(1))
    start_factor: float = _field(_Float(), 0.0)

    def _lr(self, t, base):
        warm = _linear(t, self.warmup, self.start_factor, 1.0, base)
        decayed = torch.rsqrt(t.clamp(min=self.warmup) / self.warmup) * base  # exactly b at warmup
        return torch.where(t < self.warmup, warm, decayed)

    def describe(self) -> str:
        return f"linear warmup {self.warmup} steps from {_x(self.start_factor)}, then inverse sqrt"


@dataclasses.dataclass(frozen=True)
class WSD(Schedule):
    """Warmup-stable-decay (MiniCPM, DeepSeek, torchtitan): LinearWarmup(warmup, start_factor)
    for t < warmup; b for t < warmup + stable; then min_lr + (b - min_lr) * f(q) with
    q = min(t - warmup - stable, decay) / decay and f(q) = 1 - q ("linear"),
    (1 + cos(pi * q)) / 2 ("cosine") or 1 - sqrt(q) ("sqrt"); min_lr from
    t = warmup + stable + decay on (at once when decay is 0)."""

    kind: ClassVar[str] = "wsd"
    warmup: int = _field(_Int(0))
    stable: int = _field(_Int(0))
    decay: int = _field(_Int(0))
    min_lr: float = _field(_Float(), 0.0)
    decay_shape: str = _field(_Choice(tuple(_DECAY_SHAPES)), "linear")
    start_factor: float = _field(_Float(), 0.0)

    def _lr(self, t, base):
        if self.warmup:
            warm = _linear(t, self.warmup, self.start_factor, 1.0, base)
        else:
            warm = _full(t, base)
        if self.decay:
            q = _fraction(t - (self.warmup + self.stable), self.decay)
            decayed = _anneal(_DECAY_SHAPES[self.decay_shape](q), base, self.min_lr)
        else:
            decayed = _full(t, self.min_lr)
        return torch.where(t < self.warmup + self.stable, warm, decayed)

    def describe(self) -> str:
        phases = [
            f"linear warmup {self.warmup} steps from {_x(self.start_factor)}"
            if self.warmup
            else "",
            f"stable {self.stable} steps" if self.stable else "",
            f"{self.decay_shape} decay to {self.min_lr:g} over {self.decay} steps"
            if self.decay
            else f"then {self.min_lr:g}",
        ]
        return "wsd: " + ", ".join(p for p in phases if p)

    @property
    def length(self) -> int | None:
        return self.warmup + self.stable + self.decay


@dataclasses.dataclass(frozen=True)
class Sequence(Schedule):
    """schedules[i] at t - milestones[i - 1] while milestones[i - 1] <= t < milestones[i]
    (torch SequentialLR: each schedule starts from its own epoch 0 at its milestone; where
    milestones repeat, the last of their schedules runs)."""

    kind: ClassVar[str] = "sequence"
    schedules: tuple[Schedule, ...] = _field(_Parts())
    milestones: tuple[int, ...] = _field(_Milestones())

    def _check_relations(self, error: ErrorType) -> None:
        if len(self.milestones) != len(self.schedules) - 1:
            raise error(
                f"a sequence of {len(self.schedules)} schedules needs "
                f"{len(self.schedules) - 1} milestones, got {len(self.milestones)}",
                fix=_fix(
                    error, "give one milestone (its first epoch) per schedule after the first"
                ),
            )
        if _depth(self) > MAX_DEPTH or _size(self) > MAX_SIZE:
            raise error(
                f"a sequence nested {_depth(self)} deep with {_size(self)} schedules and "
                f"milestones is over the limits ({MAX_DEPTH} deep, {MAX_SIZE} in all)",
                fix=_fix(error, "flatten the nested sequences into one"),
            )

    def _lr(self, t, base):
        value = self.schedules[0]._lr(t, base)
        for milestone, part in zip(self.milestones, self.schedules[1:], strict=True):
            later = part._lr((t - milestone).clamp(min=0), base)
            value = torch.where(t < milestone, value, later)
        return value

    def describe(self) -> str:
        text = self.schedules[0].describe()
        for i, milestone in enumerate(self.milestones):
            before = self.schedules[i]
            at = "" if before.length == milestone - _start(self, i) else f"at step {milestone} "
            text += f", then {at}{self.schedules[i + 1].describe()}"
        return text


def _start(sequence: Sequence, i: int) -> int:
    return sequence.milestones[i - 1] if i else 0


def _depth(schedule: Schedule) -> int:
    if isinstance(schedule, Sequence):
        return 1 + max(_depth(part) for part in schedule.schedules)
    return 0


def _size(schedule: Schedule) -> int:
    if isinstance(schedule, Sequence):
        return 1 + len(schedule.milestones) + sum(_size(part) for part in schedule.schedules)
    if isinstance(schedule, MultiStepDecay):
        return 1 + len(schedule.milestones)
    return 1


_KINDS: dict[str, type[Schedule]] = {
    cls.kind: cls
    for cls in (
        Constant,
        Linear,
        LinearWarmup,
        Cosine,
        LinearDecay,
        Polynomial,
        StepDecay,
        MultiStepDecay,
        ExponentialDecay,
        InverseSqrt,
        WSD,
        Sequence,
    )
}


# ------------------------------------------------------------------------ from_dict


def _decode(data: Any, where: str, *, depth: int, budget: list[int]) -> Schedule:
    cls = _class_of(data, where)
    budget[0] -= 1
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            rule, at = f.metadata["rule"], f"{where}({cls.kind}).{f.name}"
            values[f.name] = _decode_field(rule, data[f.name], at, depth, budget)
        elif f.default is dataclasses.MISSING:
            raise ArchiveError(
                f"{where}: schedule {cls.kind!r} has no {f.name!r}", fix=_ARCHIVE_FIX
            )
        else:
            values[f.name] = f.default
    if budget[0] < 0:
        raise ArchiveError(
            f"{where}: schedule is over {MAX_SIZE} parts and milestones", fix=_ARCHIVE_FIX
        )
    schedule = object.__new__(cls)  # checked below with ArchiveError, not __post_init__'s
    for name, value in values.items():
        object.__setattr__(schedule, name, value)
    _check_fields(schedule, ArchiveError)
    return schedule


def _class_of(data: Any, where: str) -> type[Schedule]:
    """The class `data["kind"]` names, once every other key is one of its fields."""
    if not isinstance(data, Mapping):
        raise _bad(where, "an object with a 'kind'", data, ArchiveError)
    kind = data.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ArchiveError(
            f"{where}: unknown schedule kind {_show(kind)}; known: {', '.join(_KINDS)}",
            fix=_ARCHIVE_FIX,
        )
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [key for key in data if key != "kind" and key not in names]
    if unknown:
        raise ArchiveError(
            f"{where}: unknown field(s) {', '.join(map(_show, unknown[:5]))} for schedule "
            f"{kind!r}; it has {', '.join(names)}",
            fix=_ARCHIVE_FIX,
        )
    return cls


def _decode_field(rule: _Rule, value: Any, where: str, depth: int, budget: list[int]) -> Any:
    if isinstance(rule, _Milestones) and isinstance(value, list | tuple):
        budget[0] -= min(len(value), MAX_MILESTONES + 1)
    if not isinstance(rule, _Parts):
        return rule.check(value, where, ArchiveError)
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_PARTS:
        raise _bad(where, f"a list of 1 to {MAX_PARTS} schedules", value, ArchiveError)
    if depth + 1 > MAX_DEPTH:
        raise ArchiveError(f"{where}: sequences nest more than {MAX_DEPTH} deep", fix=_ARCHIVE_FIX)
    return tuple(
        _decode(part, f"{where}[{i}]", depth=depth + 1, budget=budget)
        for i, part in enumerate(value)
    )


# ------------------------------------------------------------------------ torch schedulers

_USE_INSTEAD = (
    "use portable.schedules.LinearWarmup / Cosine / WSD / InverseSqrt / Sequence, or the "
    "equivalent torch scheduler (LinearLR, CosineAnnealingLR, SequentialLR, ...)"
)
_REFUSED: dict[type, tuple[str, str]] = {
    torch_sched.LambdaLR: ("a Python lambda cannot be stored in a program", _USE_INSTEAD),
    torch_sched.MultiplicativeLR: ("a Python lambda cannot be stored in a program", _USE_INSTEAD),
    torch_sched.ReduceLROnPlateau: (
        "it lowers the lr when a validation metric stops improving, and a captured step sees "
        "no metric",
        "use a fixed schedule (portable.schedules.StepDecay / MultiStepDecay / Cosine), or "
        "capture one program per lr and switch programs when your metric plateaus",
    ),
    torch_sched.ChainedScheduler: (
        "chained schedulers are not converted",
        "use one scheduler (SequentialLR for phases one after another) or a portable.schedules "
        "schedule such as WSD",
    ),
    torch_sched.CyclicLR: (
        "it is not converted (and cycles momentum too)",
        "use portable.schedules.Sequence of Linear ramps for a fixed number of cycles",
    ),
    torch_sched.OneCycleLR: (
        "it is not converted (and cycles momentum too)",
        "use portable.schedules.Sequence([LinearWarmup(...), Cosine(...)], milestones=[...]) "
        "or WSD(decay_shape='cosine')",
    ),
    torch_sched.CosineAnnealingWarmRestarts: (
        "it is not converted",
        "use portable.schedules.Sequence of Cosine schedules, one per restart",
    ),
}


def as_schedule(obj: Schedule | torch_sched.LRScheduler | None) -> tuple[Schedule, int]:
    """(schedule, start epoch) of what a capture's `schedule=` accepts: None (a constant lr),
    a portable.schedules.Schedule (starting at epoch 0), or a torch scheduler (`from_torch`)."""
    if obj is None:
        return Constant(), 0
    if isinstance(obj, Schedule):
        return obj, 0
    if isinstance(obj, torch_sched.LRScheduler):
        return from_torch(obj)
    raise CaptureError(
        f"a learning-rate schedule cannot be a {type(obj).__module__}.{type(obj).__qualname__}",
        fix="pass None, a portable.schedules.Schedule (Cosine, WSD, Sequence, ...) or a torch "
        "scheduler (LinearLR, CosineAnnealingLR, SequentialLR, StepLR, ...)",
    )


def from_torch(scheduler: torch_sched.LRScheduler) -> tuple[Schedule, int]:
    """The schedule equal to `scheduler`, and its start: scheduler.last_epoch at capture (the
    program's first step runs at lr(start)).

    Checked, never assumed: each group's current lr must be the schedule's lr at the start
    (torch continues recursively from the current lr, so a hand-set lr or a scheduler resumed
    without the optimizer's state would diverge), and base lrs must be the groups' initial_lr."""
    schedule = _convert(scheduler, restarted=False)
    start = scheduler.last_epoch
    if not isinstance(start, int) or start < 0:
        raise CaptureError(
            f"{type(scheduler).__name__}.last_epoch is {start!r}; a scheduler in use has epoch >= 0",
            fix="pass a constructed scheduler (its constructor makes the first step)",
        )
    _check_current_lr(scheduler, schedule, start)
    return schedule, start


def _convert(scheduler: Any, *, restarted: bool) -> Schedule:
    # `restarted`: a SequentialLR part after its first, entered at its milestone through the
    # scheduler's closed form at epoch 0 (which differs from its first step for total_iters=0)
    kind = type(scheduler)
    name = kind.__name__
    if kind in _REFUSED:
        what, fix = _REFUSED[kind]
        raise CaptureError(f"learning-rate scheduler {name} cannot be captured: {what}", fix=fix)
    convert = _CONVERTERS.get(kind)
    if convert is None:
        raise CaptureError(
            f"learning-rate scheduler {kind.__module__}.{kind.__qualname__} is not one portable "
            "converts (a subclass may change get_lr)",
            fix="use " + ", ".join(c.__name__ for c in _CONVERTERS) + " or a portable.schedules "
            "schedule",
        )
    if kind is not torch_sched.SequentialLR:  # it has no base_lrs; its parts do
        _check_base_lrs(scheduler)
    return convert(scheduler, restarted)


def _check_base_lrs(scheduler: Any) -> None:
    groups = scheduler.optimizer.param_groups
    initial = [float(group["initial_lr"]) for group in groups]
    if [float(b) for b in scheduler.base_lrs] != initial:
        raise CaptureError(
            f"{type(scheduler).__name__}.base_lrs {scheduler.base_lrs} are not the optimizer "
            f"groups' initial_lr {initial}",
            fix="construct the scheduler on the optimizer it steps, and do not edit base_lrs",
        )


def _check_current_lr(scheduler: Any, schedule: Schedule, start: int) -> None:
    t = torch.tensor(float(start), dtype=_F64)
    for i, group in enumerate(scheduler.optimizer.param_groups):
        base = float(group["initial_lr"])
        want = float(schedule.lr(t, base))
        for what, got in (("lr", group["lr"]), ("get_last_lr()", scheduler.get_last_lr()[i])):
            # torch's recursive updates round differently from the closed form (1e-15 relative
            # per step), and leave ~1e-16 * base where the closed form is exactly 0
            if not math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12 * base):
                raise CaptureError(
                    f"param group {i}'s {what} is {float(got):.12g}, but {schedule.describe()} "
                    f"gives {want:.12g} at epoch {start} (scheduler.last_epoch): torch continues "
                    "from the current lr, so its later lrs would not be the schedule's",
                    fix="step a freshly constructed scheduler (last_epoch=-1), or restore both "
                    "the optimizer's and the scheduler's state_dict; do not set group['lr'] by hand",
                )


def _int_arg(scheduler: Any, name: str, low: int) -> int:
    value = getattr(scheduler, name)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CaptureError(
            f"{type(scheduler).__name__}({name}={value!r}) is not converted: {name} must be an "
            f"int >= {low}",
            fix=f"pass an integer {name} >= {low}",
        )
    return value


def _float_arg(scheduler: Any, name: str) -> float:
    value = getattr(scheduler, name)
    return float(value) if isinstance(value, torch.Tensor) else value


def _constant_from(s: torch_sched.ConstantLR, restarted: bool) -> Schedule:
    total = _int_arg(s, "total_iters", 0)
    if total == 0:  # torch multiplies by factor at epoch 0 and never undoes it (its closed form
        # at a SequentialLR milestone gives 1 instead)
        return Constant(1.0 if restarted else _float_arg(s, "factor"))
    return Constant(_float_arg(s, "factor"), total)


def _linear_from(s: torch_sched.LinearLR, restarted: bool) -> Schedule:
    start, end = _float_arg(s, "start_factor"), _float_arg(s, "end_factor")
    total = _int_arg(s, "total_iters", 1 if restarted else 0)
    if total == 0:  # torch's first step multiplies by start_factor, later ones hold
        return Constant(start)
    return LinearWarmup(total, start) if end == 1.0 else Linear(start, end, total)


def _cosine_from(s: torch_sched.CosineAnnealingLR, restarted: bool) -> Schedule:
    return Cosine(_int_arg(s, "T_max", 1), _float_arg(s, "eta_min"), periodic=True)


def _polynomial_from(s: torch_sched.PolynomialLR, restarted: bool) -> Schedule:
    total = _int_arg(s, "total_iters", 1 if restarted else 0)
    if total == 0:  # torch's updates hold the base lr
        return Constant()
    return Polynomial(total, _float_arg(s, "power"))


def _step_from(s: torch_sched.StepLR, restarted: bool) -> Schedule:
    return StepDecay(_int_arg(s, "step_size", 1), _float_arg(s, "gamma"))


def _multistep_from(s: torch_sched.MultiStepLR, restarted: bool) -> Schedule:
    milestones = sorted(s.milestones.elements())
    if not all(isinstance(m, int) and not isinstance(m, bool) for m in milestones):
        raise CaptureError(
            f"MultiStepLR milestones {milestones[:8]} are not all ints",
            fix="pass integer epochs as milestones",
        )
    return MultiStepDecay(tuple(milestones), _float_arg(s, "gamma"))


def _exponential_from(s: torch_sched.ExponentialLR, restarted: bool) -> Schedule:
    return ExponentialDecay(_float_arg(s, "gamma"))


def _sequential_from(s: torch_sched.SequentialLR, restarted: bool) -> Schedule:
    parts = s._schedulers
    if any(isinstance(part, torch_sched.SequentialLR) for part in parts):
        raise CaptureError(
            "a SequentialLR inside a SequentialLR is not converted (torch cannot restart one at "
            "a milestone)",
            fix="flatten them into one SequentialLR",
        )
    milestones = list(s._milestones)
    schedule = Sequence(
        tuple(_convert(part, restarted=i > 0) for i, part in enumerate(parts)), tuple(milestones)
    )
    _check_active_part(s, milestones)
    return schedule


def _check_active_part(s: torch_sched.SequentialLR, milestones: list[int]) -> None:
    i = bisect.bisect_right(milestones, s.last_epoch)
    expected = s.last_epoch - (milestones[i - 1] if i else 0)
    active = s._schedulers[i]
    if active.last_epoch != expected:
        raise CaptureError(
            f"SequentialLR is at epoch {s.last_epoch}, so its part {i} "
            f"({type(active).__name__}) should be at epoch {expected}, but it is at "
            f"{active.last_epoch}",
            fix="step only the SequentialLR, never its parts",
        )


_CONVERTERS: dict[type, Callable[[Any, bool], Schedule]] = {
    torch_sched.ConstantLR: _constant_from,
    torch_sched.LinearLR: _linear_from,
    torch_sched.CosineAnnealingLR: _cosine_from,
    torch_sched.PolynomialLR: _polynomial_from,
    torch_sched.StepLR: _step_from,
    torch_sched.MultiStepLR: _multistep_from,
    torch_sched.ExponentialLR: _exponential_from,
    torch_sched.SequentialLR: _sequential_from,
}
