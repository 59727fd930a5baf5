"""Options of the `cuda` backend."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CudaOptions:
    """`aot`: also write an AOTInductor package per arch of the device present (needs a CUDA
    device). `torch_compile`: run the kernel graph through `torch.compile` (Inductor).
    `device`: where executables run; `"cpu"` runs the kernel graph on CPU with the Triton
    kernels in Triton's interpreter (for testing the lowering without a GPU)."""

    aot: bool = False
    torch_compile: bool = True
    device: str = "cuda"
