"""The `neuron` backend: programs lowered for AWS Trainium and validated offline.

`NeuronBackend` writes the compiler inputs (serialized HLO), the exact neuronx-cc commands, a
compile script and a manifest; nothing here needs the Neuron SDK. Importing this package does
not import JAX. See docs/backends/neuron.md.
"""

from .backend import NeuronBackend
from .options import NeuronOptions
from .targets import TARGETS, NeuronTarget

__all__ = ["TARGETS", "NeuronBackend", "NeuronOptions", "NeuronTarget"]
