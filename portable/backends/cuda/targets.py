"""CUDA architectures the `cuda` backend compiles for, and what each runs natively.

A target variant names one or more archs: `cuda:sm_90`, `cuda:sm_100`, or `cuda:sm_90,sm_100`
(what `portable lower --target cuda:sm_90 --target cuda:sm_100` asks for); plain `cuda` means
every arch. Kernels are compiled for the arch-specific feature set (`sm_90a`, `sm_100a`), which
is what Triton emits for these capabilities.
"""

from __future__ import annotations

import dataclasses

import torch

from portable.errors import BackendError

__all__ = ["ARCHS", "CudaArch", "arch_of_capability", "arch_of_device", "parse_archs"]


@dataclasses.dataclass(frozen=True)
class CudaArch:
    name: str  # "sm_90"
    capability: int  # 90: Triton's GPUTarget arch
    family: str
    gpus: str
    native_fp8: bool  # e4m3 / e5m2 tensor-core matmul (torch._scaled_mm, per-tensor scales)
    native_mx: bool  # block-scaled MX matmul (torch._scaled_mm with block-32 E8M0 scales)

    @property
    def ptx_target(self) -> str:
        """What the PTX's `.target` line names (arch-specific features: `a` suffix)."""
        return f"{self.name}a"


ARCHS: dict[str, CudaArch] = {
    "sm_90": CudaArch("sm_90", 90, "Hopper", "H100, H200, GH200", True, False),
    "sm_100": CudaArch("sm_100", 100, "Blackwell", "B200, GB200", True, True),
}


def parse_archs(variant: str | None) -> tuple[CudaArch, ...]:
    """`None` -> every arch; `"sm_90,sm_100"` -> both, in the given order, repeats dropped."""
    if variant is None:
        return tuple(ARCHS.values())
    names = list(dict.fromkeys(n.strip() for n in variant.split(",") if n.strip()))
    unknown = [n for n in names if n not in ARCHS]
    if unknown or not names:
        raise BackendError(
            f"unknown cuda arch {', '.join(unknown) or repr(variant)}",
            fix=f"archs: {', '.join(ARCHS)} (e.g. --target cuda:sm_90 --target cuda:sm_100)",
        )
    return tuple(ARCHS[n] for n in names)


def arch_of_capability(major: int, minor: int) -> CudaArch | None:
    """The arch whose kernels run on a device of this compute capability (None if none)."""
    if major == 9:
        return ARCHS["sm_90"]
    if major == 10:
        return ARCHS["sm_100"]
    return None


def arch_of_device(device: torch.device) -> CudaArch | None:
    """The arch of a CUDA device (None for a CPU device, or a CUDA device of no arch here)."""
    if device.type != "cuda":
        return None
    return arch_of_capability(*torch.cuda.get_device_capability(device))
