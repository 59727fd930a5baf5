"""`quantize` / `dequantize`: the MX semantics on CPU tensors, vectorized PyTorch.

The input is read as `[rows, block_size, inner]` (rows = outer x blocks per axis, see
`layout.py`), so no axis is ever transposed, and processed in chunks of rows (and of `inner`
when one row is larger than a chunk) of about `CHUNK` elements: every step of a chunk runs on
scratch buffers that stay in cache and are reused, instead of allocating tensor-sized
temporaries. Per chunk:

    a  = bits(x) & 0x7fffffff ; amax = max over the block (int32: NaN > Inf > finite)
    b  = scale byte (scale.py) ; y = x * 2^(127 - b)  (exact, see elements.py)
    codes = encode(y) ; blocks with b = 255 get all-zero codes
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .elements import decode_table, encode
from .formats import MXFormat
from .layout import check_dequantize, check_quantize
from .scale import reciprocal_scales, scale_bytes, scale_values

__all__ = ["dequantize", "quantize"]

CHUNK = 1 << 20  # elements per chunk: the scratch buffers (3-4 x 4 MiB) stay in cache


def _chunks(rows: int, block: int, inner: int) -> Iterator[tuple[slice, slice]]:
    """(row slice, inner slice) pairs covering [rows, block, inner] in about CHUNK elements."""
    per_row = block * inner
    if per_row <= CHUNK:
        step = CHUNK // per_row
        for r in range(0, rows, step):
            yield slice(r, min(r + step, rows)), slice(0, inner)
        return
    step = max(1, CHUNK // block)
    for r in range(rows):
        for i in range(0, inner, step):
            yield slice(r, r + 1), slice(i, min(i + step, inner))


class _Scratch:
    """Flat reusable buffers, viewed at each chunk's shape."""

    def __init__(self, n: int, need_fp32_copy: bool) -> None:
        self.y = torch.empty(n, dtype=torch.float32)
        self.a = torch.empty(n, dtype=torch.int32)
        self.work = torch.empty(n, dtype=torch.int32)
        self.x = torch.empty(n, dtype=torch.float32) if need_fp32_copy else None

    def views(self, shape: torch.Size) -> tuple[torch.Tensor, ...]:
        n = shape.numel()
        bufs = (self.y, self.a, self.work)
        return tuple(b[:n].view(shape) for b in bufs)


def _quantize_chunk(
    x: torch.Tensor,
    fmt: MXFormat,
    rule: str,
    codes: torch.Tensor,
    scales: torch.Tensor,
    scratch: _Scratch,
) -> None:
    y, a, work = scratch.views(x.shape)
    if scratch.x is not None:  # bf16 / fp16: the exact fp32 upcast
        x = scratch.x[: x.numel()].view(x.shape).copy_(x)
    x_bits = x.view(torch.int32)
    torch.bitwise_and(x_bits, 0x7FFFFFFF, out=a)
    b = scale_bytes(a.amax(dim=1), fmt, rule)
    scales.copy_(b)
    torch.mul(x, reciprocal_scales(b).unsqueeze(1), out=y)
    encode(y, x_bits, fmt, codes, a, work)
    special = b == 255
    if special.any():
        codes.masked_fill_(special.unsqueeze(1), 0)


def quantize(
    x: torch.Tensor, format: str, axis: int = -1, scale_rule: str = "floor", block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize `x` (float32, bfloat16 or float16) in blocks of `block_size` along `axis`.

    Returns `(codes, scales)`, contiguous uint8 computed on the CPU: `codes` has x's shape
    (FP4 halves `axis`: two codes per byte, element 2i in the low nibble) and holds raw element
    bit patterns (MXINT8: two's complement bytes); `scales` has `axis` divided by `block_size`
    and holds E8M0 bytes. Elements round to nearest even with subnormals and saturate to +-max
    (sign and signed zero kept); a block with NaN or +-Inf gets scale 255 and zero codes; an
    all-zero block gets scale 0. The axis length must be a multiple of `block_size` (InputError
    otherwise). bfloat16 / float16 inputs give the same bytes as their exact float32 upcast."""
    lay = check_quantize(x.shape, x.dtype, format, axis, scale_rule, block_size)
    fmt, bs = lay.fmt, lay.block_size
    codes = torch.empty(lay.codes_shape, dtype=torch.uint8)
    scales = torch.empty(lay.scales_shape, dtype=torch.uint8)
    if lay.n_blocks == 0:
        return codes, scales
    rows, inner = lay.outer * lay.blocks_per_axis, lay.inner
    xv = x.detach().to("cpu").contiguous().view(rows, bs, inner)
    cv = codes.view(rows, bs // 2 if fmt.packed else bs, inner)
    sv = scales.view(rows, inner)
    scratch = _Scratch(min(CHUNK, x.numel()), x.dtype != torch.float32)
    for r, i in _chunks(rows, bs, inner):
        _quantize_chunk(xv[r, :, i], fmt, scale_rule, cv[r, :, i], sv[r, i], scratch)
    return codes, scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, format: str, axis: int = -1,
    dtype: torch.dtype = torch.float32, block_size: int = 32,
) -> torch.Tensor:  # fmt: skip
    """The values of MX `codes` / `scales` (as `quantize` returns them), contiguous, in `dtype`.

    Each value is `element(code) * 2^(scale - 127)` computed in fp32 (exact, except that it
    becomes +-Inf beyond the fp32 range), then cast to `dtype` (round to nearest even). A block
    with scale 255 is all NaN (NaN payloads are unspecified)."""
    lay = check_dequantize(codes, scales, format, axis, dtype, block_size)
    rows, inner, bs = lay.outer * lay.blocks_per_axis, lay.inner, lay.block_size
    table = decode_table(lay.fmt)
    codes = codes.detach().to("cpu").contiguous()
    scale = scale_values(scales.detach().to("cpu").to(torch.int32)).reshape(rows, 1, inner)
    values = table[codes.to(torch.int32)]  # [..., 2] for FP4: (low, high) nibble
    if lay.fmt.packed:
        values = values.view(rows, bs // 2, inner, 2).transpose(2, 3)
    values = values.reshape(rows, bs, inner).mul_(scale)
    return values.view(lay.shape).to(dtype)
