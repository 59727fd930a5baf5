"""MX quantize / dequantize as Triton kernels, bit for bit the semantics of `portable.mx`.

`portable::mx_quantize(x, format, axis, scale_rule, block_size)` -> (codes, scales) and
`portable::mx_dequantize(codes, scales, format, axis, dtype, block_size)`; the rules are those of
`portable.mx` (shared/reference/mx.md): E8M0 scale from the exponent bits of the block amax
by the rule `scale_rule` (floor, rceil, ceil, even, emax: `portable.mx.scale`),
elements rounded to nearest even with subnormals and saturated, NaN / Inf blocks -> scale 255
and zero codes, FP4 two codes per byte (element 2i in the low nibble).

Bit-exactness. Everything is integer arithmetic on fp32 bits except three IEEE operations whose
result is exact or fixed by the semantics, compiled without FMA contraction
(`enable_fp_fusion=False`): `x * 2^(127 - b)` (a power-of-two scaling: exact wherever the result
is normal; smaller results give a zero code whatever their rounding), rceil's
`amax * fp32(1/max)` (the rule itself is defined by that fp32 product) and, in dequantize,
`element * 2^(b - 127)` (exact in fp32 range). Element rounding is one integer formula:

    k = max(E, 1) - (127 + emin)                          E = exponent field of |y|
    code = (max(k, 0) << mbits) + rne(significand, 23 - mbits + max(-k, 0))

bf16 is read and written as its 16 bit patterns (an exact shift; bf16 output rounds to nearest
even in integers), float16 through Triton's conversions (exact, or round to nearest even).

Layout. The launchers make inputs contiguous and read them as [outer, axis, inner] (see
`portable.mx.layout`), so any axis works without a transpose: block `n` (numbered like its scale
byte) is `(row, i) = (n // inner, n % inner)` and its element t sits at
`(row * BLOCK_SIZE + t) * inner + i`. One program handles BLOCKS blocks as a [BLOCKS, BLOCK_P2]
tile (FP4: two [BLOCKS, BLOCK_P2 / 2] tiles, the even and the odd elements, which pack into
one byte each). Offsets are int64. Sizes (`n_blocks`, `inner`) are runtime ints; the format,
the rule (their indices in `portable.mx.FORMATS` / `SCALE_RULES`), the block size, the tile and
the format's numeric facts are constexprs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from portable.mx import (
    FORMATS,
    SCALE_RULES,
    MXFormat,
    check_dequantize,
    check_quantize,
    dequantize_layout,
)

from . import launch
from ._layout import int_type, next_pow2

__all__ = ["dequantize", "plan_dequantize", "plan_quantize", "quantize"]

TILE = 4096  # elements per program
NUM_WARPS = 4
OPTIONS = {"enable_fp_fusion": False}
_FMT_INDEX = {name: i for i, name in enumerate(FORMATS)}

_E4M3: tl.constexpr = tl.constexpr(_FMT_INDEX["e4m3"])
_E5M2: tl.constexpr = tl.constexpr(_FMT_INDEX["e5m2"])
_INT8: tl.constexpr = tl.constexpr(_FMT_INDEX["int8"])
_FLOOR: tl.constexpr = tl.constexpr(SCALE_RULES.index("floor"))
_RCEIL: tl.constexpr = tl.constexpr(SCALE_RULES.index("rceil"))
_CEIL: tl.constexpr = tl.constexpr(SCALE_RULES.index("ceil"))
_EVEN: tl.constexpr = tl.constexpr(SCALE_RULES.index("even"))
_EMAX: tl.constexpr = tl.constexpr(SCALE_RULES.index("emax"))


# ----------------------------------------------------------------------------- shared pieces


@triton.jit
def _load_bits(X, offs, mask):
    """int32 fp32 bits of the elements at `offs` (bf16 / fp16 upcast exactly; 0 if masked)."""
    x = tl.load(X + offs, mask=mask, other=0.0)
    if X.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
    else:
        bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    return bits


@triton.jit
def _ceil_byte(bits):
    """Smallest b with 2^(b - 127) >= v, for the fp32 bits of finite v >= 0."""
    normal = (bits + 0x7FFFFF) >> 23
    return tl.where(bits < 0x800000, (bits > 0x400000).to(tl.int32), normal)


@triton.jit
def _scale_byte(amax: tl.tensor, RULE: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
                INV_MAX_BITS: tl.constexpr) -> tl.tensor:  # fmt: skip
    """E8M0 byte (int32) of blocks whose |x| maximum has the fp32 bits `amax`."""
    if RULE == _FLOOR:
        b = tl.maximum((amax >> 23) - EMAX, 0)
    elif RULE == _RCEIL:
        inv = tl.full(amax.shape, INV_MAX_BITS, tl.int32).to(tl.float32, bitcast=True)
        d = amax.to(tl.float32, bitcast=True) * inv
        b = tl.minimum(_ceil_byte(d.to(tl.int32, bitcast=True)), 254)
    elif RULE == _CEIL:
        b = tl.minimum(tl.maximum(_ceil_byte(amax) - EMAX, 0), 254)
    elif RULE == _EVEN:  # round amax to MBITS mantissa bits (ties up; a subnormal by value)
        inc = tl.where(amax < 0x800000, 1 << (21 - MBITS), 1 << (22 - MBITS))
        b = tl.minimum(tl.maximum(((amax + inc) >> 23) - EMAX, 0), 254)
    else:
        tl.static_assert(RULE == _EMAX, "unknown scale rule")
        # floor(log2 amax) + 128 - EMAX: the exponent field, one less below 2^-127
        below = (amax < 0x400000).to(tl.int32)
        b = tl.minimum(tl.maximum((amax >> 23) - below - (EMAX - 1), 0), 254)
    return tl.where(amax >= 0x7F800000, 255, b)


@triton.jit
def _encode(x_bits: tl.tensor, b: tl.tensor, FMT: tl.constexpr, BITS: tl.constexpr,
            MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_CODE: tl.constexpr) -> tl.tensor:  # fmt: skip
    """int32 codes (0..255) of a [BLOCKS, N] tile of fp32 bits with per-block bytes `b`."""
    rs = tl.where(b == 254, 0x400000, (254 - b) << 23)
    rs = tl.where(b == 255, 0x3F800000, rs).to(tl.float32, bitcast=True)  # 255: codes dropped
    y = x_bits.to(tl.float32, bitcast=True) * rs[:, None]  # x * 2^(127 - b)
    a = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    e = a >> 23
    sig = tl.where(e > 0, (a & 0x7FFFFF) | 0x800000, a)
    k = tl.maximum(e, 1) - (127 + EMIN)  # binade of |y| relative to 2^emin
    s = tl.minimum(23 - MBITS + tl.maximum(-k, 0), 25)  # dropped bits (25 or more: all)
    one = tl.full(s.shape, 1, tl.int32)
    r = (sig + (one << (s - 1)) - 1 + ((sig >> s) & 1)) >> s  # round to nearest even
    mag = tl.minimum((tl.maximum(k, 0) << MBITS) + r, MAX_CODE)
    if FMT == _INT8:
        neg = x_bits >> 31  # 0 or -1: two's complement negation
        code = ((mag ^ neg) - neg) & 0xFF
    else:
        code = mag | ((x_bits >> (32 - BITS)) & (1 << (BITS - 1)))
    return tl.where((b == 255)[:, None], 0, code)


@triton.jit
def _decode(code: tl.tensor, FMT: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr,
            EMIN: tl.constexpr) -> tl.tensor:  # fmt: skip
    """fp32 element values of int32 codes (bits above BITS ignored)."""
    if FMT == _INT8:
        v = ((code ^ 0x80) - 0x80).to(tl.float32) * 0.015625
    else:
        c = code & ((1 << BITS) - 1)
        mag = c & ((1 << (BITS - 1)) - 1)
        e = mag >> MBITS
        m = mag & ((1 << MBITS) - 1)
        sig = tl.where(e > 0, m + (1 << MBITS), m)
        # sig * 2^(max(e, 1) - bias - mbits), bias = 1 - emin: both factors and the product exact
        p = ((tl.maximum(e, 1) + EMIN - 1 - MBITS + 127) << 23).to(tl.float32, bitcast=True)
        v = sig.to(tl.float32) * p
        if FMT == _E4M3:
            v = tl.where(mag == 0x7F, float("nan"), v)
        elif FMT == _E5M2:
            v = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), v)
        v = tl.where((c >> (BITS - 1)) != 0, -v, v)
    return v


@triton.jit
def _store_values(OUT, offs, v, mask):
    """Store fp32 `v` in OUT's dtype (bf16: round to nearest even on the bits)."""
    if OUT.dtype.element_ty == tl.bfloat16:
        u = v.to(tl.int32, bitcast=True)
        h = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        h = tl.where((u & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, h)
        tl.store(OUT + offs, h.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(OUT + offs, v.to(OUT.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def mx_quantize_kernel(
    X: tl.tensor, CODES: tl.tensor, SCALES: tl.tensor, n_blocks: tl.tensor, inner: tl.tensor,
    FMT: tl.constexpr, RULE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_P2: tl.constexpr,
    BLOCKS: tl.constexpr, BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
    EMAX: tl.constexpr, MAX_CODE: tl.constexpr, INV_MAX_BITS: tl.constexpr,
) -> None:  # fmt: skip
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blk < n_blocks
    row = blk // inner
    i = blk % inner
    base = row * BLOCK_SIZE * inner + i
    if BITS == 4:  # even and odd elements: one byte per pair
        t = tl.arange(0, BLOCK_P2 // 2)
        mask = ok[:, None] & (t[None, :] < BLOCK_SIZE // 2)
        even = base[:, None] + (2 * t)[None, :] * inner
        lo = _load_bits(X, even, mask)
        hi = _load_bits(X, even + inner, mask)
        amax = tl.maximum(tl.max(lo & 0x7FFFFFFF, axis=1), tl.max(hi & 0x7FFFFFFF, axis=1))
        b = _scale_byte(amax, RULE, EMAX, MBITS, INV_MAX_BITS)
        code = _encode(lo, b, FMT, BITS, MBITS, EMIN, MAX_CODE)
        code = code | (_encode(hi, b, FMT, BITS, MBITS, EMIN, MAX_CODE) << 4)
        offs = (row * (BLOCK_SIZE // 2) * inner + i)[:, None] + t[None, :] * inner
    else:
        t = tl.arange(0, BLOCK_P2)
        mask = ok[:, None] & (t[None, :] < BLOCK_SIZE)
        offs = base[:, None] + t[None, :] * inner
        x_bits = _load_bits(X, offs, mask)
        amax = tl.max(x_bits & 0x7FFFFFFF, axis=1)
        b = _scale_byte(amax, RULE, EMAX, MBITS, INV_MAX_BITS)
        code = _encode(x_bits, b, FMT, BITS, MBITS, EMIN, MAX_CODE)
    tl.store(CODES + offs, code.to(tl.uint8), mask=mask)
    tl.store(SCALES + blk, b.to(tl.uint8), mask=ok)


@triton.jit
def mx_dequantize_kernel(
    CODES: tl.tensor, SCALES: tl.tensor, OUT: tl.tensor, n_blocks: tl.tensor, inner: tl.tensor,
    FMT: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCKS: tl.constexpr,
    BITS: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
) -> None:  # fmt: skip
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blk < n_blocks
    row = blk // inner
    i = blk % inner
    base = row * BLOCK_SIZE * inner + i
    b = tl.load(SCALES + blk, mask=ok, other=0).to(tl.int32)
    scale = tl.where(b == 0, 0x400000, b << 23)
    scale = tl.where(b == 255, 0x7FC00000, scale).to(tl.float32, bitcast=True)[:, None]
    if BITS == 4:
        t = tl.arange(0, BLOCK_P2 // 2)
        mask = ok[:, None] & (t[None, :] < BLOCK_SIZE // 2)
        c_offs = (row * (BLOCK_SIZE // 2) * inner + i)[:, None] + t[None, :] * inner
        byte = tl.load(CODES + c_offs, mask=mask, other=0).to(tl.int32)
        even = base[:, None] + (2 * t)[None, :] * inner
        _store_values(OUT, even, _decode(byte & 0xF, FMT, BITS, MBITS, EMIN) * scale, mask)
        _store_values(OUT, even + inner, _decode(byte >> 4, FMT, BITS, MBITS, EMIN) * scale, mask)
    else:
        t = tl.arange(0, BLOCK_P2)
        mask = ok[:, None] & (t[None, :] < BLOCK_SIZE)
        offs = base[:, None] + t[None, :] * inner
        code = tl.load(CODES + offs, mask=mask, other=0).to(tl.int32)
        _store_values(OUT, offs, _decode(code, FMT, BITS, MBITS, EMIN) * scale, mask)


# ----------------------------------------------------------------------------- plans


def _tile(block_size: int) -> dict[str, int]:
    block_p2 = next_pow2(block_size)
    return {"BLOCK_SIZE": block_size, "BLOCK_P2": block_p2, "BLOCKS": max(1, TILE // block_p2)}


def _format_constexprs(fmt: MXFormat) -> dict[str, int]:
    return {"BITS": fmt.bits, "MBITS": fmt.mbits, "EMIN": fmt.emin}


def _launch(kernel: str, fn: object, pointers: dict[str, str], n_blocks: int, inner: int,
            constexprs: dict[str, int]) -> list[launch.KernelLaunch]:  # fmt: skip
    if n_blocks == 0:
        return []
    itype = int_type(n_blocks, inner)
    signature = {**pointers, "n_blocks": itype, "inner": itype}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return [
        launch.KernelLaunch(
            kernel=kernel,
            fn=fn,
            signature=signature,
            constexprs=constexprs,
            grid=(-(-n_blocks // constexprs["BLOCKS"]),),
            grid_rule="(cdiv(n_blocks, BLOCKS),)",
            num_warps=NUM_WARPS,
            num_stages=1,
            options=dict(OPTIONS),
        )
    ]


def plan_quantize(
    shape: Sequence[int], dtype: torch.dtype, format: str, axis: int,
    scale_rule: str = "floor", block_size: int = 32,
) -> list[launch.KernelLaunch]:  # fmt: skip
    """The launches `quantize` runs for an input of `shape` / `dtype` (no tensor needed; [] for
    an empty input). Runtime args: (x, codes, scales, n_blocks, inner)."""
    lay = check_quantize(shape, dtype, format, axis, scale_rule, block_size)
    fmt = lay.fmt
    constexprs = {
        "FMT": _FMT_INDEX[fmt.name],
        "RULE": SCALE_RULES.index(scale_rule),
        **_tile(block_size),
        **_format_constexprs(fmt),
        "EMAX": fmt.emax,
        "MAX_CODE": fmt.max_code,
        "INV_MAX_BITS": fmt.inv_max_bits,
    }
    pointers = {"X": launch.triton_type(dtype), "CODES": "*u8", "SCALES": "*u8"}
    return _launch("mx_quantize", mx_quantize_kernel, pointers, lay.n_blocks, lay.inner,
                   constexprs)  # fmt: skip


def plan_dequantize(
    codes_shape: Sequence[int], format: str, axis: int, dtype: torch.dtype, block_size: int = 32
) -> list[launch.KernelLaunch]:
    """The launches `dequantize` runs for codes of `codes_shape` ([] when empty). Runtime args:
    (codes, scales, out, n_blocks, inner)."""
    lay = dequantize_layout(codes_shape, format, axis, dtype, block_size)
    constexprs = {"FMT": _FMT_INDEX[lay.fmt.name], **_tile(block_size),
                  **_format_constexprs(lay.fmt)}  # fmt: skip
    pointers = {"CODES": "*u8", "SCALES": "*u8", "OUT": launch.triton_type(dtype)}
    return _launch("mx_dequantize", mx_dequantize_kernel, pointers, lay.n_blocks, lay.inner,
                   constexprs)  # fmt: skip


# ----------------------------------------------------------------------------- launchers


def quantize(
    x: torch.Tensor, format: str, axis: int, scale_rule: str = "floor", block_size: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """`portable.mx.quantize` on x's device: (codes, scales), contiguous uint8 (CPU tensors run
    in Triton's interpreter)."""
    plans = plan_quantize(x.shape, x.dtype, format, axis, scale_rule, block_size)
    lay = check_quantize(x.shape, x.dtype, format, axis, scale_rule, block_size)
    x = x.contiguous()
    codes = torch.empty(lay.codes_shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty(lay.scales_shape, dtype=torch.uint8, device=x.device)
    for plan in plans:
        launch.run(plan, x, codes, scales, lay.n_blocks, lay.inner)
    return codes, scales


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, format: str, axis: int,
    dtype: torch.dtype = torch.float32, block_size: int = 32,
) -> torch.Tensor:  # fmt: skip
    """`portable.mx.dequantize` on the codes' device, contiguous in `dtype`."""
    lay = check_dequantize(codes, scales, format, axis, dtype, block_size)
    plans = plan_dequantize(codes.shape, format, axis, dtype, block_size)
    codes, scales = codes.contiguous(), scales.to(codes.device).contiguous()
    out = torch.empty(lay.shape, dtype=dtype, device=codes.device)
    for plan in plans:
        launch.run(plan, codes, scales, out, lay.n_blocks, lay.inner)
    return out
