"""Step-time, memory and MFU planning of training programs on accelerator fleets."""

from .systems import System, system

__all__ = ["System", "system"]
