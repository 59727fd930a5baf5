"""FP4 packing: two 4-bit codes per byte along one dim, element 2i in the low nibble
(codes [7, 5] pack to 0x57)."""

from __future__ import annotations

import torch

__all__ = ["pack_fp4", "unpack_fp4"]


def pack_fp4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 bytes `codes[2i] | codes[2i + 1] << 4` along `dim` (of even length)."""
    dim = dim % codes.dim()
    low, high = codes.unflatten(dim, (codes.shape[dim] // 2, 2)).unbind(dim + 1)
    return (low.to(torch.uint8) & 0xF) | ((high.to(torch.uint8) & 0xF) << 4)


def unpack_fp4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """uint8 4-bit codes, twice as long along `dim`: the inverse of `pack_fp4`."""
    dim = dim % packed.dim()
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=dim + 1)
    return pairs.flatten(dim, dim + 1)
