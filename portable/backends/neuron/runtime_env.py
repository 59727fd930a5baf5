"""The Neuron runtime environment a program expects, as name -> value (with the reason for each).

- NEURON_LOGICAL_NC_CONFIG must equal the compile's `--logical-nc-config` (trn2, trn3: 2);
  trn1 has no logical cores and takes neither.
- NEURON_RT_VISIBLE_CORES: the cores the process uses; a single-device program needs one.
- NEURON_RT_STOCHASTIC_ROUNDING_EN=1 for training steps that compute in bf16, so small updates
  to bf16 weights are not rounded away.
"""

from __future__ import annotations

from portable.ir.program import Program, ProgramKind

from .hlo import HloModule
from .options import NeuronOptions
from .targets import NeuronTarget

__all__ = ["runtime_env"]


def runtime_env(
    target: NeuronTarget, options: NeuronOptions, program: Program, module: HloModule
) -> dict[str, dict[str, str]]:
    """Environment variable -> {"value", "why"}."""
    env: dict[str, dict[str, str]] = {}
    if target.logical_nc_config is not None:
        env["NEURON_LOGICAL_NC_CONFIG"] = {
            "value": str(target.logical_nc_config),
            "why": "must equal --logical-nc-config of the compile",
        }
    world = _world_size(program)
    env["NEURON_RT_VISIBLE_CORES"] = (
        {
            "value": f"0-{world - 1}",
            "why": f"one logical core per rank: {world} ranks (per node: cores of this node)",
        }
        if world > 1
        else {
            "value": options.visible_cores,
            "why": "one logical core runs this single-device program",
        }
    )
    bf16 = any("bf16" in ins.elements for ins in module.instructions())
    if program.kind is ProgramKind.TRAINING_STEP and bf16:
        env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] = {
            "value": "1",
            "why": "bf16 training: stochastic rounding keeps small weight updates",
        }
    return env


def _world_size(program: Program) -> int:
    return program.spmd.size if program.spmd is not None else 1
