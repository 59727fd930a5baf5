"""Trainium generations as data: compiler target, logical-core config, HBM budget, number formats,
and the topologies (chips per node, nodes per scale-up domain) each generation ships in.

Figures come from docs/reference (neuron.md, hardware.md): HBM per logical NeuronCore is what one
program may use (weights + gradients + optimizer state + activations, leaving headroom). A node is
one instance (server) with its own Neuron runtime: it decides which replica groups are intra-node
and the per-node NEURON_RT_VISIBLE_CORES. Topologies, from the Neuron architecture pages:
trn1.32xlarge and trn2.48xlarge have 16 chips; a Trn2 UltraServer is 4 trn2.48xlarge (64 chips);
a Trn3 Gen1 UltraServer is 4 servers x 16 chips, a Gen2 UltraServer 36 servers x 4 chips.
"""

from __future__ import annotations

import dataclasses

from portable.errors import BackendError

__all__ = [
    "DEFAULT_VARIANT",
    "TARGETS",
    "TOPOLOGIES",
    "NeuronTarget",
    "Topology",
    "resolve_target",
]

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Topology:
    """How one generation's chips are grouped into nodes (instances) and scale-up domains."""

    name: str  # the `topology` option's value
    generation: str  # the target variant it belongs to
    chips_per_node: int  # chips per instance (node): one Neuron runtime, one VISIBLE_CORES range
    nodes_per_domain: int  # nodes in one NeuronLink / NeuronSwitch domain (UltraServer); 1: none
    basis: str  # the source of the figures, for the manifest

    def to_json(self, cores_per_chip: int) -> dict[str, object]:
        return {
            "name": self.name,
            "chips_per_node": self.chips_per_node,
            "cores_per_node": self.chips_per_node * cores_per_chip,
            "nodes_per_domain": self.nodes_per_domain,
            "chips_per_domain": self.chips_per_node * self.nodes_per_domain,
            "basis": self.basis,
        }


TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        Topology(
            "trn3-gen1",
            "trn3",
            chips_per_node=16,
            nodes_per_domain=4,
            basis="Trn3 Gen1 UltraServer: 4 servers x 16 Trainium3 chips (Neuron trn3 "
            "architecture page)",
        ),
        Topology(
            "trn3-gen2",
            "trn3",
            chips_per_node=4,
            nodes_per_domain=36,
            basis="Trn3 Gen2 UltraServer: 36 servers x 4 Trainium3 chips (Neuron trn3 "
            "architecture page)",
        ),
        Topology(
            "trn2",
            "trn2",
            chips_per_node=16,
            nodes_per_domain=1,
            basis="trn2.48xlarge: 16 Trainium2 chips",
        ),
        Topology(
            "trn2-ultraserver",
            "trn2",
            chips_per_node=16,
            nodes_per_domain=4,
            basis="Trn2 UltraServer: 4 trn2.48xlarge x 16 Trainium2 chips (64 chips)",
        ),
        Topology(
            "trn1",
            "trn1",
            chips_per_node=16,
            nodes_per_domain=1,
            basis="trn1.32xlarge: 16 Trainium chips (Neuron Trainium architecture page)",
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class NeuronTarget:
    """One Trainium generation as `neuronx-cc --target` sees it."""

    name: str  # the target variant: trn1, trn2, trn3
    logical_nc_config: int | None  # `--logical-nc-config` / NEURON_LOGICAL_NC_CONFIG; None: omit
    hbm_per_core_bytes: int  # HBM of one logical NeuronCore
    hbm_basis: str  # how the budget was derived, for the manifest
    fp8_types: frozenset[str]  # HLO FP8 element types the generation computes with
    mx: bool  # MX block-scaled formats (QuantizeMX, __op$block_scaled_dot)
    cores_per_chip: int = 4  # logical NeuronCores per chip (one rank each)
    cores_basis: str = ""  # where cores_per_chip comes from, for the manifest
    topology: Topology = TOPOLOGIES["trn3-gen1"]  # the nodes the ranks are placed on

    @property
    def compiler_target(self) -> str:
        return self.name

    @property
    def chips_per_node(self) -> int:
        return self.topology.chips_per_node

    @property
    def cores_per_node(self) -> int:
        """Logical cores (ranks) per node: NEURON_RT_VISIBLE_CORES counts these."""
        return self.cores_per_chip * self.topology.chips_per_node

    def with_topology(self, name: str | None) -> NeuronTarget:
        """This generation placed on topology `name` (None: its default); BackendError for a
        topology of another generation or an unknown name."""
        if name is None:
            return self
        topology = TOPOLOGIES.get(name)
        if topology is None or topology.generation != self.name:
            mine = [t for t, v in TOPOLOGIES.items() if v.generation == self.name]
            raise BackendError(
                f"topology {name!r} is not a neuron:{self.name} topology"
                + (f" (it is {topology.generation}'s)" if topology is not None else ""),
                fix=f"topologies of neuron:{self.name}: {', '.join(mine)}",
            )
        return dataclasses.replace(self, topology=topology)


TARGETS: dict[str, NeuronTarget] = {
    t.name: t
    for t in (
        NeuronTarget(
            "trn3",
            logical_nc_config=2,
            hbm_per_core_bytes=36 * GiB,
            hbm_basis="Trainium3: 144 GiB HBM per chip, 4 logical cores at LNC=2",
            # EVRF051/052: e4m3fn is Trn3+, e4m3 up to Trn3: Trn3 takes both (validate_ops.py)
            fp8_types=frozenset({"f8e4m3fn", "f8e4m3", "f8e5m2"}),
            mx=True,
            cores_per_chip=4,
            cores_basis="Trainium3: 8 NeuronCore-v4 per chip = 4 logical cores at LNC=2",
            topology=TOPOLOGIES["trn3-gen1"],
        ),
        NeuronTarget(
            "trn2",
            logical_nc_config=2,
            hbm_per_core_bytes=24 * GiB,
            hbm_basis="Trainium2: 96 GiB HBM per chip, 4 logical cores at LNC=2",
            fp8_types=frozenset({"f8e4m3", "f8e5m2"}),
            mx=False,
            cores_per_chip=4,
            cores_basis="Trainium2: 8 NeuronCore-v3 per chip = 4 logical cores at LNC=2",
            topology=TOPOLOGIES["trn2"],
        ),
        NeuronTarget(
            "trn1",
            logical_nc_config=None,
            hbm_per_core_bytes=16 * GiB,
            hbm_basis="Trainium1: 16 GiB HBM per NeuronCore-v2 (no logical-core grouping)",
            fp8_types=frozenset({"f8e4m3", "f8e5m2"}),
            mx=False,
            cores_per_chip=2,
            cores_basis="Trainium1: 2 NeuronCore-v2 per chip (no logical-core grouping)",
            topology=TOPOLOGIES["trn1"],
        ),
    )
}

DEFAULT_VARIANT = "trn3"


def resolve_target(variant: str | None, topology: str | None = None) -> NeuronTarget:
    """The generation of `neuron[:variant]` (trn3 when no variant is given) on `topology` (None:
    the generation's default: trn3-gen1, trn2, trn1)."""
    name = variant or DEFAULT_VARIANT
    if name not in TARGETS:
        raise BackendError(
            f"unknown target neuron:{name}",
            fix=f"variants of neuron: {', '.join(TARGETS)} (default {DEFAULT_VARIANT})",
        )
    return TARGETS[name].with_topology(topology)
