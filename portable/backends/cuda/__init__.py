"""The `cuda` backend: PyTorch + Triton for sm_90 (Hopper) and sm_100 (Blackwell).

Importing this package does not import triton; lowering and running do.
"""

from __future__ import annotations

from .backend import CudaBackend
from .options import CudaOptions
from .pt2 import load_pt2

__all__ = ["CudaBackend", "CudaOptions", "load_pt2"]
