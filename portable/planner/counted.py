"""What counting a training step yields (`costs.count`): per segment, its work as coefficients
of micro-batch and tensor-parallel degree, `q(b, t) = q0 + b q1 + (q2 + b q3) / t`
(costs.py's docstring says how they are measured; estimate.py prices them)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from ..errors import PlannerError

__all__ = [
    "POLICIES",
    "EMBED",
    "HEAD",
    "OPTIMIZER",
    "ZERO",
    "Coeffs",
    "Collective",
    "Costs",
    "Gemm",
    "Segment",
    "Work",
]

POLICIES = ("none", "selective", "full")  # recomputation policies (costs.py)
EMBED, HEAD, OPTIMIZER = "embed", "head", "optimizer"


@dataclasses.dataclass(frozen=True)
class Coeffs:
    """`q(b, t) = rep + b * rep_b + (split + b * split_b) / t` (module docstring)."""

    rep: float = 0.0
    rep_b: float = 0.0
    split: float = 0.0
    split_b: float = 0.0

    def at(self, b: float, t: float) -> float:
        return self.rep + b * self.rep_b + (self.split + b * self.split_b) / t

    def parts(self, b: float) -> tuple[float, float]:
        """(repeated, divided-by-t) at micro-batch `b`."""
        return self.rep + b * self.rep_b, self.split + b * self.split_b

    @staticmethod
    def fit(
        q11: float, q21: float, q12: float, q22: float, batches: tuple[int, int] = (1, 2)
    ) -> Coeffs:
        """From the values at (b, t) = (b1, 1), (b2, 1), (b1, 2), (b2, 2), `batches` = (b1, b2)."""
        b1, b2 = batches
        slope1, slope2 = (q21 - q11) / (b2 - b1), (q22 - q12) / (b2 - b1)
        base1, base2 = q11 - b1 * slope1, q12 - b1 * slope2
        return Coeffs(
            2 * base2 - base1, 2 * slope2 - slope1, 2 * (base1 - base2), 2 * (slope1 - slope2)
        )

    def __add__(self, other: Coeffs) -> Coeffs:
        return Coeffs(
            self.rep + other.rep,
            self.rep_b + other.rep_b,
            self.split + other.split,
            self.split_b + other.split_b,
        )

    def scaled(self, factor: float) -> Coeffs:
        return Coeffs(
            self.rep * factor, self.rep_b * factor, self.split * factor, self.split_b * factor
        )


ZERO = Coeffs()


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a segment: `kind` (all_reduce, all_gather, ...), `phase`, and the
    bytes of the full tensor it reduces or gathers (`bytes.at(b, t)`)."""

    kind: str
    phase: str
    bytes: Coeffs


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix product: FLOPs, operand + result bytes, and its output as `batch` products
    of `rows x cols` (zeros for fused attention and convolutions, which have no tile model)."""

    flops: Coeffs
    bytes: Coeffs
    batch: Coeffs = ZERO
    rows: Coeffs = ZERO
    cols: Coeffs = ZERO


@dataclasses.dataclass(frozen=True)
class Work:
    """One phase of a segment: matmul FLOPs, memory-bound bytes, kernel count, and each
    matmul's `Gemm` (FLOPs, operand + result bytes, output shape), for its own roofline and
    wave quantization (`gemms`, in program order; empty when the four programs' matmuls do not
    pair up)."""

    flops: Coeffs = ZERO
    bytes: Coeffs = ZERO
    kernels: float = 0.0
    gemms: tuple[Gemm, ...] = ()

    def __add__(self, other: Work) -> Work:
        return Work(
            self.flops + other.flops,
            self.bytes + other.bytes,
            self.kernels + other.kernels,
            self.gemms + other.gemms,
        )


@dataclasses.dataclass(frozen=True)
class Segment:
    """A layer (or the embed / head part) of the step: forward and backward work, the work each
    recomputation policy repeats, saved activation bytes per policy, its collectives, and its
    parameters (`params`: elements, `param_bytes`: bytes at the program's dtypes)."""

    name: str
    forward: Work
    backward: Work
    recompute: Mapping[str, Work]
    saved: Mapping[str, Coeffs]
    collectives: tuple[Collective, ...]
    params: Coeffs
    param_bytes: Coeffs
    mlp: Work  # the forward + backward work of the layer's MLP (MoE scales it by top_k)


@dataclasses.dataclass(frozen=True)
class Costs:
    """A training step's costs: its segments in program order (`layers` are the repeated
    ones), the optimizer's bytes per parameter element, model FLOPs per token."""

    segments: tuple[Segment, ...]
    optimizer_bytes_per_param: float
    optimizer_kernels: float
    seq: int
    model_flops_per_sample: float  # forward + backward matmul FLOPs of one sample, t = 1
    source: str
    hidden: int = 0  # the model's width (activation bytes between stages, context exchange)
    kv_width: int = 0  # key (= value) width per token
    experts: int = 0
    routed: int = 1
    heads: int = 0  # attention heads (TP must divide them); 0 when unknown

    @functools.cached_property
    def layers(self) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.name not in (EMBED, HEAD))

    @functools.cached_property
    def distinct_layers(self) -> tuple[tuple[Segment, int], ...]:
        """Each distinct layer (by its counted work) and how many layers repeat it."""
        counts: dict[int, list[Any]] = {}
        for seg in self.layers:
            row = counts.setdefault(id(seg.forward), [seg, 0])
            row[1] += 1
        return tuple((seg, n) for seg, n in counts.values())

    def segment(self, name: str) -> Segment:
        for s in self.segments:
            if s.name == name:
                return s
        raise PlannerError(f"no segment {name!r}", fix="use one of the program's segments")

    def with_layers(self, count: int) -> Costs:
        """These costs with the repeated layer (the program's first) repeated `count` times:
        for a program captured with fewer blocks than the model has."""
        layers = self.layers
        if not layers:
            raise PlannerError("the program has no repeated layers", fix="capture a layered model")
        template = layers[0]
        rest = [s for s in self.segments if s.name in (EMBED, HEAD)]
        blocks = [dataclasses.replace(template, name=f"layer.{i}") for i in range(count)]
        embed = [s for s in rest if s.name == EMBED]
        head = [s for s in rest if s.name == HEAD]
        per_sample = self.model_flops_per_sample + (count - len(layers)) * (
            template.forward.flops.at(1, 1) + template.backward.flops.at(1, 1)
        )
        return dataclasses.replace(
            self, segments=(*embed, *blocks, *head), model_flops_per_sample=per_sample
        )
