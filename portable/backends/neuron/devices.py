"""Which devices run a neuron lowering here: the Neuron PJRT plugin's, or XLA:CPU standing in.

On a Trn host with the Neuron SDK's JAX plugin (libneuronxla, usually through jax-neuronx), JAX
has a `neuron` platform: `jax.devices("neuron")` lists one device per visible logical NeuronCore,
and `jax.jit` on them hands the HLO to neuronx-cc (the plugin compiles and caches the NEFF).
Elsewhere there is no such platform, and the neuron backend and the `neuron` job engine refuse
with a BackendError, unless `PORTABLE_NEURON_STAND_IN=cpu` is set: then XLA:CPU devices run the
same neuron lowering. The switch is read when devices are asked for (never at import time), and
is meant for tests and CI, not for choosing a backend.

`neuron_here()` answers without importing JAX when no Neuron plugin is installed (no
`libneuronxla` module, no `jax_plugins` entry point naming neuron), so listing backends stays
cheap off Trainium.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import entry_points
from typing import Any

from portable.errors import BackendError

__all__ = ["NEURON_STAND_IN", "neuron_devices", "neuron_here", "stand_in"]

NEURON_STAND_IN = "PORTABLE_NEURON_STAND_IN"  # "cpu": XLA:CPU devices stand in for NeuronCores
_PLUGIN = "libneuronxla"


def stand_in() -> bool:
    """Whether XLA:CPU stands in for NeuronCores in this process (PORTABLE_NEURON_STAND_IN=cpu)."""
    return os.environ.get(NEURON_STAND_IN) == "cpu"


def neuron_devices() -> list[Any]:
    """The JAX devices that run neuron lowerings: the Neuron plugin's, else (with the stand-in
    switch) XLA:CPU's; BackendError naming the plugin and the switch otherwise."""
    import jax

    try:
        devices = jax.devices("neuron")
    except RuntimeError as exc:
        if stand_in():
            return jax.devices("cpu")
        raise BackendError(
            "running neuron programs needs the Neuron PJRT plugin (jax-neuronx with "
            f"libneuronxla on a Trn host); JAX here has no neuron devices "
            f"({str(exc).splitlines()[0]})",
            fix="run on a trn1/trn2/trn3 host with the Neuron SDK's jax-neuronx installed; off "
            f"Trainium, {NEURON_STAND_IN}=cpu runs the same neuron lowering on XLA:CPU",
        ) from exc
    return devices


def neuron_here() -> tuple[bool, str]:
    """(True, "") when neuron programs can run in this process, else (False, why)."""
    if stand_in():
        return True, ""
    if not _plugin_installed():
        return False, f"the Neuron PJRT plugin ({_PLUGIN}, from jax-neuronx) is not installed"
    try:
        neuron_devices()
    except BackendError as exc:
        return False, exc.what
    return True, ""


def _plugin_installed() -> bool:
    if importlib.util.find_spec(_PLUGIN) is not None:
        return True
    return any("neuron" in ep.name.lower() for ep in entry_points(group="jax_plugins"))
