"""`Parallelism`: one training configuration the planner prices.

Degrees follow Megatron-LM's names and rank order (tensor parallel fastest, then context, then
data, then pipeline): `tp`, `cp` (context parallel: the sequence split over ranks), `ep`
(expert parallel, inside the data-parallel ranks), `dp`, `pp` with `schedule` `1f1b` or
`interleaved` (`virtual` model chunks per stage), `zero` (0: replicated optimizer, 1:
distributed optimizer state, 2: and gradients, 3: and parameters, FSDP), `sequence_parallel`
(Korthikanti et al.), `recompute` (`none`, `selective`: the core attention, `full`: the
whole layer), the micro-batch (`None`: the planner picks) and the number format of the
matrix products (`precision`, a key of the system's per-format peaks).

Overlap switches: `overlap_grad_reduce` reduces gradients over data parallel while the last
micro-batch's backward runs (Megatron's `--overlap-grad-reduce`, FSDP's prefetch);
`overlap_tp_comm` runs each column-parallel linear's backward collective (the input gradient's
all-reduce; under sequence parallelism its reduce-scatter) beside that linear's own
weight-gradient matmul (Megatron-LM's asynchronous tensor-parallel all-reduce, on by default
since late 2021; torchtitan's async TP). Off reproduces an engine that waits for every
collective.
"""

from __future__ import annotations

import dataclasses

from ..errors import PlannerError
from .counted import POLICIES

__all__ = ["SCHEDULES", "Parallelism"]

SCHEDULES = ("1f1b", "interleaved")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """One configuration (module docstring). `dp=None` fills the devices left by the others."""

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    global_batch: int = 1
    micro_batch: int | None = None
    schedule: str = "1f1b"
    virtual: int = 1
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "bfloat16"
    overlap_grad_reduce: bool = True
    overlap_tp_comm: bool = True
    grad_bytes: int = 2  # bytes per gradient element reduced over data parallel

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "cp", "ep", "global_batch", "virtual", "grad_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlannerError(f"Parallelism.{field}={value!r}", fix=f"{field} >= 1")
        for field in ("dp", "micro_batch"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PlannerError(f"Parallelism.{field}={value!r}", fix=f"{field} >= 1 or None")
        if self.recompute not in POLICIES:
            raise PlannerError(
                f"recompute={self.recompute!r}", fix=f"use one of {', '.join(POLICIES)}"
            )
        if self.schedule not in SCHEDULES:
            raise PlannerError(
                f"schedule={self.schedule!r}", fix=f"use one of {', '.join(SCHEDULES)}"
            )
        if self.schedule == "1f1b" and self.virtual != 1:
            raise PlannerError(
                f"virtual={self.virtual} with schedule='1f1b'",
                fix="virtual chunks per stage need schedule='interleaved'",
            )
        if self.zero not in (0, 1, 2, 3):
            raise PlannerError(f"zero={self.zero!r}", fix="zero is 0, 1, 2 or 3 (FSDP)")
        if self.sequence_parallel and self.tp == 1:
            raise PlannerError(
                "sequence_parallel=True with tp=1",
                fix="sequence parallelism splits the tensor-parallel ranks' replicated work",
            )

    def data_parallel(self, devices: int) -> int:
        """The data-parallel degree on `devices` (PlannerError when the degrees do not fit)."""
        model = self.tp * self.pp * self.cp
        if self.dp is not None:
            if self.dp * model != devices:
                raise PlannerError(
                    f"tp*pp*cp*dp = {self.tp}*{self.pp}*{self.cp}*{self.dp} = "
                    f"{self.dp * model}, not the system's {devices} devices",
                    fix="make the degrees multiply to the device count (or leave dp=None)",
                )
            return self.dp
        if devices % model:
            raise PlannerError(
                f"tp*pp*cp = {model} does not divide {devices} devices",
                fix="pick degrees whose product divides the device count",
            )
        return devices // model

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.schedule == "interleaved":
            parts[-1] += f"x{self.virtual}"
        if self.dp is not None:
            parts.append(f"dp{self.dp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.zero:
            parts.append("fsdp" if self.zero == 3 else f"zero{self.zero}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(f"mb{self.micro_batch}" if self.micro_batch else "mb?")
        parts.append(f"rc:{self.recompute}")
        return " ".join(parts)
