"""The `xla` backend (XLA:CPU through JAX) and the lowering rules shared with `neuron`.

Importing this package does not import JAX; the backend imports it when used."""

from .backend import XlaBackend

__all__ = ["XlaBackend"]
