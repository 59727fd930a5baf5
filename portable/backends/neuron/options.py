"""Options of the `neuron` backend: compiler flags and validator policy, checked on construction."""

from __future__ import annotations

import dataclasses

from portable.errors import BackendError

from .targets import TOPOLOGIES

__all__ = ["NeuronOptions"]

_CHOICES = {
    "fp64": ("downcast", "error"),
    "model_type": ("transformer", "generic", "unet-inference"),
    "auto_cast": ("none", "matmult", "all"),
    "optlevel": (1, 2, 3),
    "mx": ("native", "emulate", "stand-in"),
}


@dataclasses.dataclass(frozen=True)
class NeuronOptions:
    """`fp64`: no NeuronCore computes in float64. "downcast" lowers every float64 value as
    float32 and reports each one as a warning; "error" refuses the program.

    `model_type`, `auto_cast`, `optlevel` become `--model-type`, `--auto-cast`, `-O<n>`.
    `hbm_headroom` is the fraction of a core's HBM kept free: an estimate above
    (1 - headroom) x budget is a warning, above the budget an error.
    `max_instructions` is the HLO instruction count above which the graph-size warning fires:
    a heuristic for compile time and host memory. No HLO instruction limit is published; the
    compiler's limit (NCC_EVRF007 / EBVF030 / EXTP004) is on the instructions it generates.
    `visible_cores` is the NEURON_RT_VISIBLE_CORES the manifest recommends for a single-device
    program (a per-rank program's ranges are computed per node from the topology).
    `topology` places the ranks on nodes (targets.TOPOLOGIES): "trn3-gen1" (4 servers x 16
    chips, trn3's default), "trn3-gen2" (36 servers x 4 chips), "trn2", "trn2-ultraserver",
    "trn1"; None: the target's default. It decides which replica groups cross nodes and the
    per-node NEURON_RT_VISIBLE_CORES, never the compile.
    `mx`: how MX GEMMs lower on a target with MX (trn3; mx_native.py). "native": QuantizeMX +
    `__op$block_scaled_dot` where the recipe fits them; "emulate": integer HLO everywhere;
    "stand-in": the native structure with each custom call replaced by its XLA:CPU stand-in
    (runs here, for parity; not a compiler input).
    """

    fp64: str = "downcast"
    model_type: str = "transformer"
    auto_cast: str = "none"
    optlevel: int = 1
    hbm_headroom: float = 0.1
    max_instructions: int = 150_000
    visible_cores: str = "0"
    topology: str | None = None
    mx: str = "native"

    def __post_init__(self) -> None:
        for field, allowed in _CHOICES.items():
            value = getattr(self, field)
            if value not in allowed:
                raise BackendError(
                    f"neuron option {field}={value!r} is not one of "
                    f"{', '.join(repr(a) for a in allowed)}",
                    fix=f"pass {field}= one of those values",
                )
        if not 0.0 <= self.hbm_headroom < 1.0:
            raise BackendError(
                f"neuron option hbm_headroom={self.hbm_headroom} is outside [0, 1)",
                fix="pass the fraction of HBM to keep free, e.g. 0.1",
            )
        if self.topology is not None and self.topology not in TOPOLOGIES:
            raise BackendError(
                f"neuron option topology={self.topology!r} is not one of "
                f"{', '.join(repr(t) for t in TOPOLOGIES)}",
                fix="pass topology= one of those (or leave it out: the target's default)",
            )
        if self.max_instructions <= 0:
            raise BackendError(
                f"neuron option max_instructions={self.max_instructions} must be positive",
                fix="pass an instruction count, e.g. 150000",
            )
