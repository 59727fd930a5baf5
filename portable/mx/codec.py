"""`quantize` / `dequantize`: the MX semantics on CPU tensors, vectorized PyTorch.

The input is read as `[rows, block_size, inner]` (rows = outer x blocks per axis, see
`layout.py`), so no axis is ever transposed, and processed in chunks of rows (and of `inner`
when one row is larger than a chunk) of about `CHUNK` elements: every step of a chunk runs on
scratch buffers that stay in cache and are reused, instead of allocating tensor-sized
temporaries. Per chunk of quantize:

    a  = bits(x) & 0x7fffffff ; amax = max over the block (int32: NaN > Inf > finite)
    b, 2^(127 - b) = scale table[key(amax)]      (tables.py; NaN / Inf blocks: b = 255)
    y  = x * 2^(127 - b)                         (exact, see elements.py)
    codes = float8 cast of y (E4M3, E5M2), table[16-bit key of y] (E3M2, E2M3, E2M1), or
            integer rounding (MXINT8); blocks with b = 255 get all-zero codes

and of dequantize: `decode table[code] * 2^(b - 127)` in float32, then a cast to the dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .elements import decode_pairs, decode_table, encode_integer_path
from .formats import MXFormat
from .layout import check_dequantize, check_quantize
from .scale import ABS_MASK, INF_BITS, scale_values
from .tables import encode_keys, encode_table, scale_keys, scale_table, uses_encode_table

__all__ = ["dequantize", "quantize"]

CHUNK = 1 << 19  # elements per chunk: scratch buffers of 2 MiB, reused (in cache), and blocks
# per chunk (16 Ki) below torch's parallel grain, so per-block ops run inline
NEVER_CLIP = ("rceil", "ceil", "emax")  # rules under which no E4M3 / E5M2 element saturates


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
        self.low = torch.empty(n, dtype=torch.uint8)
        self.high = torch.empty(n, dtype=torch.uint8)
        self.x = torch.empty(n, dtype=torch.float32) if need_fp32_copy else None

    def view(self, name: str, shape: torch.Size) -> torch.Tensor:
        return getattr(self, name)[: shape.numel()].view(shape)


def _table_codes(y: torch.Tensor, table: torch.Tensor, out: torch.Tensor, s: _Scratch) -> None:
    """`out` (uint8, y's shape, contiguous) = `table[key(y)]` of fp32 `y` (tables.py)."""
    key = encode_keys(y.view(torch.int32), s.view("work", y.shape))
    torch.index_select(table, 0, key.view(-1), out=out.view(-1))


def _encode(y: torch.Tensor, x_bits: torch.Tensor, fmt: MXFormat, rule: str, out: torch.Tensor,
            s: _Scratch) -> None:  # fmt: skip
    """Write the codes of scaled fp32 `y` (signs from int32 `x_bits`) into uint8 `out` (FP4:
    half of dim 1, element 2i in the low nibble). `y` may be overwritten."""
    if fmt.torch_dtype is not None:  # the cast rounds to nearest even but does not saturate
        if rule not in NEVER_CLIP:
            y.clamp_(-fmt.max_value, fmt.max_value)
        out.view(fmt.torch_dtype).copy_(y)
    elif uses_encode_table(fmt) and fmt.packed:
        pairs = y.unflatten(1, (y.shape[1] // 2, 2))
        low, high = s.view("low", out.shape), s.view("high", out.shape)
        _table_codes(pairs[:, :, 0], encode_table(fmt), low, s)
        _table_codes(pairs[:, :, 1], encode_table(fmt, 4), high, s)
        torch.bitwise_or(low, high, out=out)
    elif uses_encode_table(fmt):
        direct = out.is_contiguous()
        codes = out if direct else s.view("low", out.shape)
        _table_codes(y, encode_table(fmt), codes, s)
        if not direct:
            out.copy_(codes)
    else:  # MXINT8: two's complement bytes
        a, work = s.view("a", y.shape), s.view("work", y.shape)
        out.view(torch.int8).copy_(encode_integer_path(y, x_bits, fmt, a, work))


def _quantize_chunk(
    x: torch.Tensor, fmt: MXFormat, rule: str, codes: torch.Tensor, scales: torch.Tensor,
    s: _Scratch,
) -> None:  # fmt: skip
    if s.x is not None:  # bf16 / fp16: the exact fp32 upcast
        x = s.view("x", x.shape).copy_(x)
    x_bits = x.view(torch.int32)
    amax = torch.bitwise_and(x_bits, ABS_MASK, out=s.view("a", x.shape)).amax(dim=1)
    b_table, rs_table = scale_table(fmt, rule)
    key = scale_keys(amax, fmt, rule).view(-1)
    scales.copy_(torch.index_select(b_table, 0, key).view(amax.shape))
    rs = torch.index_select(rs_table, 0, key).view(amax.shape).unsqueeze(1)
    y = torch.mul(x, rs, out=s.view("y", x.shape))
    _encode(y, x_bits, fmt, rule, codes, s)
    if int(amax.max()) >= INF_BITS:  # NaN / Inf blocks: byte 255, zero codes
        special = amax >= INF_BITS
        scales.masked_fill_(special, 255)
        codes.masked_fill_(special.unsqueeze(1), 0)


def quantize(
    x: torch.Tensor, format: str, axis: int = -1, scale_rule: str = "floor", block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """MX-quantize `x` (float32, bfloat16 or float16) in blocks of `block_size` along `axis`.

    Returns `(codes, scales)`, contiguous uint8 computed on the CPU: `codes` has x's shape
    (FP4 halves `axis`: two codes per byte, element 2i in the low nibble) and holds raw element
    bit patterns (MXINT8: two's complement bytes); `scales` has `axis` divided by `block_size`
    and holds E8M0 bytes chosen by `scale_rule` (floor, rceil, ceil, even, emax: `scale.py`).
    Elements round to nearest even with subnormals and saturate to +-max (sign and signed zero
    kept); a block with NaN or +-Inf gets scale 255 and zero codes; an all-zero block gets
    scale 0. The axis length must be a multiple of `block_size` (InputError otherwise).
    bfloat16 / float16 inputs give the same bytes as their exact float32 upcast."""
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


def _dequantize_chunk(codes: torch.Tensor, scale: torch.Tensor, fmt: MXFormat,
                      out: torch.Tensor, s: _Scratch) -> None:  # fmt: skip
    """`out` ([rows, block, inner]) = decode(codes) * scale[:, None, :], in fp32 then out's
    dtype. Two 8-bit codes, or one FP4 byte, decode at once where adjacent in memory (one
    int64 of two fp32 values per table entry)."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    values = out if direct else s.view("y", out.shape)
    flat, n = values.view(-1), codes.numel()
    if fmt.packed and codes.shape[2] == 1:  # inner 1: elements 2i, 2i + 1 are adjacent
        idx = s.a[:n].copy_(codes.reshape(-1))
        torch.index_select(decode_pairs(fmt), 0, idx, out=flat.view(torch.int64))
    elif fmt.packed:
        idx = s.a[:n].copy_(codes.reshape(-1))
        pairs = torch.index_select(decode_table(fmt), 0, idx).view(*codes.shape, 2)
        values.unflatten(1, (codes.shape[1], 2)).copy_(pairs.movedim(-1, 2))
    elif n % 2 == 0 and codes.is_contiguous():  # code pairs as uint16 keys
        idx = s.a[: n // 2].copy_(codes.view(-1).view(torch.uint16))
        torch.index_select(decode_pairs(fmt), 0, idx, out=flat.view(torch.int64))
    else:
        idx = s.a[:n].copy_(codes.reshape(-1))
        torch.index_select(decode_table(fmt), 0, idx, out=flat)
    values.mul_(scale.unsqueeze(1))
    if not direct:
        out.copy_(values)


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
    out = torch.empty(lay.shape, dtype=dtype)
    if lay.n_blocks == 0:
        return out
    packed = lay.fmt.packed
    cv = codes.detach().to("cpu").contiguous().view(rows, bs // 2 if packed else bs, inner)
    scale = scale_values(scales.detach().to("cpu").to(torch.int32)).view(rows, inner)
    ov = out.view(rows, bs, inner)
    scratch = _Scratch(min(CHUNK, out.numel()), False)
    for r, i in _chunks(rows, bs, inner):
        _dequantize_chunk(cv[r, :, i], scale[r, i], lay.fmt, ov[r, :, i], scratch)
    return out
