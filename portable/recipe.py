"""The training recipe of a captured step, as data: precision, loss scaling, clipping,
accumulation, rematerialization and the learning-rate schedule.

`Recipe` is what `portable.capture(..., schedule=, clip_grad_norm=, clip_grad_value=,
precision=, accumulate=, remat=)` records in `program.metadata["recipe"]`, so an archive carries
it and `portable inspect` shows it. Each field maps to the eager PyTorch code it replaces
(docs/training-recipe.md):

- `precision`: `torch.autocast(device_type, dtype=compute)` around the forward and loss, with
  parameters and optimizer state kept in `params` (fp32 master weights) and gradients in
  `reduce`; float16 adds dynamic loss scaling (`LossScale`, as `torch.amp.GradScaler`);
- `clip_grad_norm` / `clip_grad_value`: `torch.nn.utils.clip_grad_norm_` (global L2 norm over
  every trainable parameter, eps 1e-6) / `clip_grad_value_`, after accumulation and unscaling;
- `accumulate`: the batch split into N micro-batches along dim 0, `(loss_fn(m, *mb) / N)
  .backward()` per micro-batch, one optimizer step;
- `schedule` (`portable.schedules`) from `start`: the lr of the step with counter t is
  `schedule.lr(start + t, base_lr)` for each parameter group;
- `remat`: the `remat{policy=...}` pass applied to the step;
- `seed`: the key of the counter-based dropout generator (`portable.random`), program state
  `rng.seed` next to the per-micro-batch counter `rng.offset`.

`Recipe.from_dict` reads untrusted data (archives): every field is checked, nothing is evaluated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .errors import ArchiveError, CaptureError
from .schedules import Schedule

__all__ = ["REMAT_POLICIES", "LossScale", "Precision", "Recipe", "recipe_of"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REMAT_POLICIES = ("none", "full", "selective", "save-matmuls")


def _dtype_name(value: Any, field: str) -> str:
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if value not in _DTYPES:
        raise CaptureError(
            f"Precision({field}={value!r}) is not a dtype portable trains in",
            fix=f"use one of {', '.join(_DTYPES)}",
        )
    return str(value)


@dataclasses.dataclass(frozen=True)
class LossScale:
    """Dynamic loss scaling, `torch.amp.GradScaler`'s algorithm and defaults: the loss is
    multiplied by `scale` before the backward; gradients are unscaled after it; a step whose
    gradients hold an inf or NaN is skipped (parameters, optimizer state and the step counter
    unchanged) and the scale multiplied by `backoff`; after `interval` good steps in a row it is
    multiplied by `growth`."""

    init: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    def __post_init__(self) -> None:
        ok = (
            _finite_positive(self.init)
            and _finite_positive(self.growth)
            and self.growth > 1
            and _finite_positive(self.backoff)
            and self.backoff < 1
            and type(self.interval) is int
            and 0 < self.interval < 2**31
        )
        if not ok:
            raise CaptureError(
                f"bad {self}: init and growth > 1 and 0 < backoff < 1 must be finite, interval a "
                "positive int",
                fix="use LossScale() (GradScaler's defaults) or valid values",
            )


@dataclasses.dataclass(frozen=True)
class Precision:
    """`compute`: the dtype the forward and backward run in (torch.autocast's policy: matmuls,
    convolutions and attention in `compute`, losses and the other precision-sensitive ops in
    float32, the rest in the dtype of their inputs); `params`: the dtype of parameters and
    optimizer state (the master weights); `reduce`: the dtype gradients are accumulated and
    reduced in. float16 compute scales the loss (`loss_scale`)."""

    compute: str = "float32"
    params: str = "float32"
    reduce: str = "float32"
    loss_scale: LossScale | None = None

    def __post_init__(self) -> None:
        for field in ("compute", "params", "reduce"):
            object.__setattr__(self, field, _dtype_name(getattr(self, field), field))
        if self.params != "float32" or self.reduce != "float32":
            raise CaptureError(
                f"Precision(params={self.params!r}, reduce={self.reduce!r}): portable keeps "
                "parameters, optimizer state and gradients in float32",
                fix="use params='float32', reduce='float32' (the default); `compute` sets the "
                "precision of the forward and backward",
            )
        if self.compute == "float16" and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScale())
        if self.compute != "float16" and self.loss_scale is not None:
            raise CaptureError(
                f"loss scaling with compute={self.compute!r}",
                fix="loss scaling is for float16 compute; drop loss_scale",
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.compute]

    @property
    def mixed(self) -> bool:
        return self.compute != "float32"

    def describe(self) -> str:
        if not self.mixed:
            return "float32"
        scale = ", dynamic loss scaling" if self.loss_scale else ""
        return f"{self.compute} compute (torch.autocast policy), float32 master weights{scale}"


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything about a training step besides the model, the loss and the optimizer."""

    schedule: Any = None  # portable.schedules.Schedule; None: constant lr
    start: int = 0  # the schedule's step at the program's first step
    clip_grad_norm: float | None = None
    clip_grad_value: float | None = None
    precision: Precision = dataclasses.field(default_factory=Precision)
    accumulate: int = 1
    remat: str = "none"
    seed: int = 0  # the dropout generator's seed (program state rng.seed)

    def __post_init__(self) -> None:
        for name in ("clip_grad_norm", "clip_grad_value"):
            value = getattr(self, name)
            if value is not None and not _finite_positive(value):
                raise CaptureError(
                    f"{name}={value!r} must be a positive finite number",
                    fix=f"pass {name}=1.0 (or leave it out for no clipping)",
                )
        if type(self.accumulate) is not int or not 1 <= self.accumulate <= 4096:
            raise CaptureError(
                f"accumulate={self.accumulate!r} must be an int from 1 to 4096",
                fix="pass the number of micro-batches the batch is split into",
            )
        if type(self.start) is not int or not 0 <= self.start < 2**53:
            raise CaptureError(f"schedule start {self.start!r} must be an int >= 0")
        if type(self.seed) is not int or not -(2**63) <= self.seed < 2**63:
            raise CaptureError(f"seed={self.seed!r} must be an int64", fix="pass seed=0, 1, ...")
        if self.remat not in REMAT_POLICIES:
            raise CaptureError(
                f"remat={self.remat!r} is not a policy",
                fix=f"use one of {', '.join(REMAT_POLICIES)}",
            )

    def describe(self) -> list[str]:
        """One line per recipe feature, for `portable inspect`."""
        lines = [f"precision: {self.precision.describe()}"]
        if self.schedule is not None:
            at = f" (from step {self.start})" if self.start else ""
            lines.append(f"schedule: {self.schedule.describe()}{at}")
        if self.clip_grad_norm is not None:
            lines.append(f"clip: global L2 norm to {self.clip_grad_norm:g}")
        if self.clip_grad_value is not None:
            lines.append(f"clip: values to [-{self.clip_grad_value:g}, {self.clip_grad_value:g}]")
        if self.accumulate > 1:
            lines.append(f"accumulate: {self.accumulate} micro-batches per step")
        if self.remat != "none":
            lines.append(f"remat: {self.remat}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        precision = dataclasses.asdict(self.precision)
        return {
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "start": self.start,
            "clip_grad_norm": self.clip_grad_norm,
            "clip_grad_value": self.clip_grad_value,
            "precision": precision,
            "accumulate": self.accumulate,
            "remat": self.remat,
            "seed": self.seed,
        }

    @staticmethod
    def from_dict(data: Any) -> Recipe:
        """The recipe an archive recorded (untrusted: ArchiveError on anything malformed)."""
        fields = {"schedule", "start", "clip_grad_norm", "clip_grad_value", "precision"}
        fields |= {"accumulate", "remat", "seed"}
        if not isinstance(data, dict) or set(data) - fields:
            raise ArchiveError("malformed training recipe", fix="re-save the archive")
        try:
            precision = _precision_from(data.get("precision", {}))
            schedule = data.get("schedule")
            return Recipe(
                schedule=None if schedule is None else Schedule.from_dict(schedule),
                start=data.get("start", 0),
                clip_grad_norm=_number_or_none(data.get("clip_grad_norm")),
                clip_grad_value=_number_or_none(data.get("clip_grad_value")),
                precision=precision,
                accumulate=data.get("accumulate", 1),
                remat=data.get("remat", "none"),
                seed=data.get("seed", 0),
            )
        except CaptureError as exc:
            raise ArchiveError(
                f"bad training recipe: {exc.what}", fix="re-save the archive"
            ) from exc


def recipe_of(metadata: dict[str, Any]) -> Recipe:
    """The recipe a training step's metadata records; programs saved before recipes existed
    trained at a constant lr in float32 without clipping, which is the default Recipe."""
    data = metadata.get("recipe")
    return Recipe() if data is None else Recipe.from_dict(data)


def _precision_from(data: Any) -> Precision:
    if not isinstance(data, dict) or set(data) - {"compute", "params", "reduce", "loss_scale"}:
        raise CaptureError("malformed precision")
    scale = data.get("loss_scale")
    if scale is not None:
        if not isinstance(scale, dict) or set(scale) - {"init", "growth", "backoff", "interval"}:
            raise CaptureError("malformed loss_scale")
        scale = LossScale(**{k: v for k, v in scale.items()})
    return Precision(
        compute=data.get("compute", "float32"),
        params=data.get("params", "float32"),
        reduce=data.get("reduce", "float32"),
        loss_scale=scale,
    )


def _number_or_none(value: Any) -> float | None:
    if value is None:
        return None
    if type(value) not in (int, float):
        raise CaptureError(f"{value!r} is not a number")
    return float(value)


def _finite_positive(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0
