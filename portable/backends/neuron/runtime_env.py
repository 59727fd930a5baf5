"""The Neuron runtime environment a program expects, as name -> value (with the reason for each).

- NEURON_LOGICAL_NC_CONFIG must equal the compile's `--logical-nc-config` (trn2, trn3: 2);
  trn1 has no logical cores and takes neither.
- NEURON_RT_VISIBLE_CORES: the cores the process uses, a range of THIS instance's cores (runtime
  configuration guide: "Range of specific NeuronCores needed by the process"), so per node: a
  per-rank program's ranks fill the target topology's nodes (cores_per_chip x chips_per_node
  logical cores each) and every node sets the range of its own ranks' cores, "0-63" on each
  trn2.48xlarge at LNC=2 for instance, not the global rank range. A single-device program needs
  one core.
- NEURON_RT_STOCHASTIC_ROUNDING_EN=1 for training steps that compute in bf16, so small updates
  to bf16 weights are not rounded away.
"""

from __future__ import annotations

from typing import Any

from portable.ir.program import Program, ProgramKind

from .hlo import HloModule
from .options import NeuronOptions
from .targets import NeuronTarget

__all__ = ["runtime_env", "visible_cores"]


def runtime_env(
    target: NeuronTarget, options: NeuronOptions, program: Program, module: HloModule
) -> dict[str, dict[str, Any]]:
    """Environment variable -> {"value", "why"} (and "per_node" for NEURON_RT_VISIBLE_CORES of
    a per-rank program)."""
    env: dict[str, dict[str, Any]] = {}
    if target.logical_nc_config is not None:
        env["NEURON_LOGICAL_NC_CONFIG"] = {
            "value": str(target.logical_nc_config),
            "why": "must equal --logical-nc-config of the compile",
        }
    world = _world_size(program)
    env["NEURON_RT_VISIBLE_CORES"] = (
        visible_cores(target, world)
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


def visible_cores(target: NeuronTarget, world: int) -> dict[str, Any]:
    """NEURON_RT_VISIBLE_CORES of a `world`-rank program, per node of `target`'s topology:
    {"value" (node 0's range; every node's when they are equal), "why", "per_node": [{"node",
    "ranks" (the global ranks it runs), "value"}]}."""
    per_node = target.cores_per_node
    nodes = -(-world // per_node)
    entries = []
    for node in range(nodes):
        first = node * per_node
        count = min(per_node, world - first)
        entries.append({"node": node, "ranks": _range(first, count), "value": _range(0, count)})
    same = len({e["value"] for e in entries}) == 1
    topology = target.topology
    why = (
        f"one logical core per rank: {world} ranks on {nodes} node(s) of {per_node} logical "
        f"cores ({topology.name}: {topology.chips_per_node} chips x {target.cores_per_chip} "
        "cores); the range counts this instance's cores, so it is set per node"
    )
    if not same:
        why += f"; the last node runs {world - (nodes - 1) * per_node} ranks"
    return {"value": entries[0]["value"], "why": why, "per_node": entries}


def _range(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def _world_size(program: Program) -> int:
    return program.spmd.size if program.spmd is not None else 1
