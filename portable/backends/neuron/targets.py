"""Trainium generations as data: compiler target, logical-core config, HBM budget, number formats.

Figures come from docs/reference (neuron.md, hardware.md): HBM per logical NeuronCore is what one
program may use (weights + gradients + optimizer state + activations, leaving headroom).
"""

from __future__ import annotations

import dataclasses

from portable.errors import BackendError

__all__ = ["DEFAULT_VARIANT", "TARGETS", "NeuronTarget", "resolve_target"]

GiB = 1 << 30


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
    chips_per_node: int = 16  # chips per instance (node)
    topology_basis: str = ""  # where the two figures above come from, for the manifest

    @property
    def compiler_target(self) -> str:
        return self.name


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
            chips_per_node=16,
            topology_basis="Trainium3: 8 NeuronCore-v4 per chip = 4 logical cores at LNC=2 "
            "(hardware.md); 16 chips per node assumed as on trn2.48xlarge (hardware.md gives "
            "only UltraServer sizes for Trn3: 64 or 144 chips); check against the instance",
        ),
        NeuronTarget(
            "trn2",
            logical_nc_config=2,
            hbm_per_core_bytes=24 * GiB,
            hbm_basis="Trainium2: 96 GiB HBM per chip, 4 logical cores at LNC=2",
            fp8_types=frozenset({"f8e4m3", "f8e5m2"}),
            mx=False,
            cores_per_chip=4,
            chips_per_node=16,
            topology_basis="Trainium2: 8 NeuronCore-v3 per chip = 4 logical cores at LNC=2; "
            "trn2.48xlarge has 16 chips (hardware.md)",
        ),
        NeuronTarget(
            "trn1",
            logical_nc_config=None,
            hbm_per_core_bytes=16 * GiB,
            hbm_basis="Trainium1: 16 GiB HBM per NeuronCore-v2 (no logical-core grouping)",
            fp8_types=frozenset({"f8e4m3", "f8e5m2"}),
            mx=False,
            cores_per_chip=2,
            chips_per_node=16,
            topology_basis="Trainium1: 2 NeuronCore-v2 per chip; trn1.32xlarge has 16 chips",
        ),
    )
}

DEFAULT_VARIANT = "trn3"


def resolve_target(variant: str | None) -> NeuronTarget:
    """The generation of `neuron[:variant]` (trn3 when no variant is given)."""
    name = variant or DEFAULT_VARIANT
    if name not in TARGETS:
        raise BackendError(
            f"unknown target neuron:{name}",
            fix=f"variants of neuron: {', '.join(TARGETS)} (default {DEFAULT_VARIANT})",
        )
    return TARGETS[name]
