"""The NVIDIA Blackwell (cuBLAS / CUTLASS block-scaled GEMM) layout of E8M0 scales.

A [rows, cols] scale matrix (rows = the operand's M or N, cols = K / 32) is zero-padded to
rows a multiple of 128 and cols a multiple of 4, then cut into 128x4 tiles stored one after the
other, row of tiles by row of tiles (tile (i, j) starts at byte `(i * cols_padded / 4 + j) * 512`).
Inside a tile, scale (r, c) goes to offset `(r % 32) * 16 + (r // 32) * 4 + c`: the four 32-row
groups of the tile are interleaved so one 16-byte row holds a scale of each group and column.
"""

from __future__ import annotations

import torch

from portable.errors import InputError

__all__ = ["swizzle_scales", "unswizzle_scales"]


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """The 1-D swizzled bytes of 2-D `scales`: length `pad(rows, 128) * pad(cols, 4)`."""
    if scales.dim() != 2:
        raise InputError(
            f"swizzle_scales takes a 2-D [rows, cols] scale matrix, got shape {list(scales.shape)}",
            fix="reshape the scales of the GEMM operand to [rows, K // 32]",
        )
    rows, cols = scales.shape
    rp, cp = _padded(rows, 128), _padded(cols, 4)
    padded = scales.new_zeros(rp, cp)
    padded[:rows, :cols] = scales
    # [tile_r, 4 groups of 32 rows, 32, tile_c, 4] -> [tile_r, tile_c, 32, 4 groups, 4]
    tiles = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def unswizzle_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The [rows, cols] scale matrix back from `swizzle_scales` output (padding dropped)."""
    rp, cp = _padded(rows, 128), _padded(cols, 4)
    if swizzled.numel() != rp * cp:
        raise InputError(
            f"{swizzled.numel()} swizzled scale bytes do not fit [{rows}, {cols}] "
            f"(expected {rp} x {cp} = {rp * cp} after padding)",
            fix="pass the rows and cols of the matrix that was swizzled",
        )
    tiles = swizzled.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(rp, cp)[:rows, :cols].contiguous()
