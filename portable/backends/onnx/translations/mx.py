"""`portable::mx_quantize` / `portable::mx_dequantize` as ONNX: the bytes of `portable.mx`.

`TRANSLATIONS` maps both ops to onnxscript functions in the form
`torch.onnx.export(..., dynamo=True, custom_translation_table=...)` takes. The exporter calls
them while tracing with ONNX values for tensors and plain Python values for `format`, `axis`,
`scale_rule` and `block_size` (and the ONNX type number for `dtype`), so every format / rule
choice is made here, in Python, and the graph holds only the arithmetic of the one chosen.

Contract. `mx_quantize` returns exactly the `(codes, scales)` of `portable.mx.quantize`
(shared/reference/mx.md) for every format (E4M3, E5M2, E3M2, E2M3, E2M1 packed two per byte
with element 2i in the low nibble, MXINT8), every scale rule (floor, rceil, ceil, even, emax),
any axis and block size, float32 / bfloat16 / float16 input (the bytes of the exact float32
upcast), NaN / Inf blocks (scale 255, zero codes) and zero blocks. `mx_dequantize` returns exactly the values of
`portable.mx.dequantize` in float32, bfloat16, float16 and float64, NaN payloads aside. Checked
bit for bit on ONNX Runtime (CPU) by tests/test_mx_backends.py.

Why no FP8 / FP4 / E8M0 tensor types. ONNX has them (FLOAT8E4M3FN, FLOAT8E5M2 since opset 19,
FLOAT4E2M1 since 23, FLOAT8E8M0 since 24), but no type exists for E3M2 / E2M3 (FP6) or MXINT8,
a cast to E8M0 rounds in ONNX's modes rather than by these scale rules, and the op's outputs are
*uint8 bytes*: turning a float8 value into its byte needs `BitCast`, which only opset 26 has.
The exporter builds the graph at torchlib's opset 18 and converts it to the requested opset
afterwards, and that converter has no adapter for `BitCast` (export fails). So the graph is
an ONNX-function-style decomposition that is exact with opset-18 operators for every format,
and it converts to any later opset:

- Float bits are never reinterpreted. A value's exponent is found by a binary search of exact
  comparisons with powers of two gathered from a constant table (no `Log`: a float log rounds up
  just below a power of two), its mantissa by exact power-of-two multiplications and a cast of
  the resulting integer-valued float; from there the scale rules are the int32 formulas of
  `portable.mx.scale`. Only the block maxima (one value per block) take the 8-step search.
- Elements: `y = |x| * 2^(127 - b)` (an exact power-of-two product, as in `portable.mx`),
  saturated with `Min(y, max)`, its binade `k` in `[emin, emax]` found by a short search (0 to
  5 steps by format), then `Round(y * 2^(mbits - k))` (ONNX `Round` is round-half-to-even) plus
  `(k - emin) << mbits` is the magnitude code: subnormals (`k = emin`) and the rounding carry
  into the next binade come out of the same formula. The sign comes from `x < 0` or
  `1 / x < 0` (so -0 keeps its sign bit); MXINT8 negates in two's complement.
- Dequantize is two table lookups (`Gather`): the element value of every code byte (or nibble)
  and the E8M0 value `2^(b - 127)` of every scale byte (255: NaN; 0: the fp32 subnormal
  2^-127), one float32 product (the reference's one rounding), then `Cast` to the output dtype
  (round to nearest even, as torch).

Blocks are a `Reshape` of the quantized axis into `[-1, block_size]` between the other dims
(the shape comes from `Shape`, so dynamic dims stay dynamic); the block maximum is one
`ReduceMax`. Every op is vectorized over the whole tensor; a quantize is about 40 to 100 nodes
depending on the format and rule (most are per-block or constant), a dequantize about 12.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import numpy as np
import torch
from onnxscript import FLOAT, INT32, ir
from onnxscript import opset18 as op

from portable import mx
from portable.errors import InputError, LoweringError
from portable.ir.source import source_of
from portable.mx.elements import decode_table
from portable.mx.formats import MXFormat
from portable.mx.scale import scale_values
from portable.opset import bind, op_name

__all__ = ["DQ_OP", "Q_OP", "TRANSLATIONS", "check_node", "mx_dequantize", "mx_quantize"]

Q_OP = torch.ops.portable.mx_quantize.default
DQ_OP = torch.ops.portable.mx_dequantize.default

F32 = ir.DataType.FLOAT
I32 = ir.DataType.INT32
U8 = ir.DataType.UINT8
HIDDEN = 0x800000  # 2^23: the implicit leading one of a normal fp32 significand
_TORCH = {
    ir.DataType.FLOAT: torch.float32,
    ir.DataType.BFLOAT16: torch.bfloat16,
    ir.DataType.FLOAT16: torch.float16,
    ir.DataType.DOUBLE: torch.float64,
    ir.DataType.UINT8: torch.uint8,
}


# ----------------------------------------------------------------------------- constants


def _const(value, dtype=np.int32):
    """A constant tensor (scalar or array) of numpy `dtype`."""
    tensor = ir.tensor(np.asarray(value, dtype=dtype))
    return op.Constant(value=tensor)  # type: ignore[arg-type]  # the stub says TensorProto; ir.Tensor works


def _pow2_table() -> np.ndarray:
    """float32 `POW2[k]` with the bits `k << 23`: `2^(k - 127)` for k in 1..254, 0 and +Inf."""
    return (np.arange(256, dtype=np.int64) << 23).astype(np.uint32).view(np.float32)


def _pow2(index):
    """Exact `2^(index - 127)` (float32) of int32 `index` in 1..254."""
    return op.Gather(_const(_pow2_table(), np.float32), index)


# onnxscript's stubs type a Cast's result as any tensor type: these two give the one `to` fixes.


def _as_int(value) -> INT32:
    """int32 of integer values (uint8 bytes, or integer-valued float32: exact)."""
    return cast(INT32, op.Cast(value, to=I32))


def _to_f32(x) -> FLOAT:
    """float32 `x`."""
    return cast(FLOAT, op.Cast(x, to=F32))


def _split_axis(x, axis: int, sizes: list[int]):
    """The shape of `x` with dim `axis` replaced by `sizes` (one of them may be -1)."""
    return op.Concat(
        op.Shape(x, end=axis), _const(sizes, np.int64), op.Shape(x, start=axis + 1), axis=0
    )


# ----------------------------------------------------------------------------- bits of floats


def _exponent_field(v):
    """int32 biased exponent field of finite float32 `v >= 0` (0 for zero and subnormals): the
    largest k with 2^(k - 127) <= v, by an 8-step binary search of exact comparisons."""
    e = None
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        cand = _const(step) if e is None else op.Add(e, _const(step))
        hit = op.GreaterOrEqual(v, _pow2(cand))
        e = op.Where(hit, cand, _const(0) if e is None else e)
    return e


def _fp32_bits(v):
    """int32 bits of finite float32 `v >= 0`: `E << 23 | m`. The mantissa field is
    `v * 2^(150 - E) - 2^23` (normal) or `v * 2^149` (subnormal), exact integers in float32
    reached by two power-of-two products (2^149 is not a float32)."""
    e = _exponent_field(v)
    normal = op.Greater(e, _const(0))
    # 2^(127 - E) for a normal v (2^-127 at E = 254 is an exact subnormal), 2^126 otherwise
    inv = op.Gather(_const(_reciprocal_table(), np.float32), op.Where(normal, e, _const(1)))
    sig = _as_int(op.Mul(op.Mul(v, inv), _const(float(HIDDEN), np.float32)))
    mantissa = op.Sub(sig, op.Where(normal, _const(HIDDEN), _const(0)))
    return op.Add(op.Mul(e, _const(HIDDEN)), mantissa)


def _reciprocal_table() -> np.ndarray:
    """float32 `2^(127 - b)` of every scale byte b (254: the subnormal 2^-127; 255, a NaN
    block whose codes are discarded: 1), as `portable.mx.scale.reciprocal_scales`."""
    b = np.arange(256, dtype=np.int64)
    bits = np.where(b == 254, 0x00400000, (254 - b) << 23)
    bits = np.where(b == 255, 0x3F800000, bits)
    return bits.astype(np.uint32).view(np.float32)


# ----------------------------------------------------------------------------- scale bytes


def _ceil_byte(bits):
    """Smallest b with 2^(b - 127) >= v, for the int32 bits of finite v >= 0 (as
    `portable.mx.scale.ceil_byte`)."""
    normal = op.Div(op.Add(bits, _const(0x7FFFFF)), _const(HIDDEN))
    subnormal = op.Cast(op.Greater(bits, _const(0x400000)), to=I32)
    return op.Where(op.Less(bits, _const(HIDDEN)), subnormal, normal)


def _scale_bytes(amax, fmt: MXFormat, rule: str):
    """int32 E8M0 bytes (0..254) of blocks with finite float32 maximum `amax`."""
    if rule == "rceil":  # C(fp32(amax * fp32(1 / max))): never clips
        inv = np.array(fmt.inv_max_bits, dtype=np.int32).view(np.float32)
        d = op.Mul(amax, _const(inv, np.float32))
        return op.Min(_ceil_byte(_fp32_bits(d)), _const(254))
    if rule == "floor":
        e = _exponent_field(amax)
    else:
        bits = _fp32_bits(amax)
        if rule == "ceil":
            e = _ceil_byte(bits)
        elif rule == "even":  # round to mbits mantissa bits, ties up (a subnormal by its value)
            inc = op.Where(
                op.Less(bits, _const(HIDDEN)),
                _const(1 << (21 - fmt.mbits)),
                _const(1 << (22 - fmt.mbits)),
            )
            e = op.Div(op.Add(bits, inc), _const(HIDDEN))
        elif rule == "emax":  # floor(log2 amax) + 128: the exponent field + 1, 0 below 2^-127
            below = op.Cast(op.Less(bits, _const(0x400000)), to=I32)
            e = op.Sub(op.Add(op.Div(bits, _const(HIDDEN)), _const(1)), below)
        else:
            raise ValueError(rule)
    return op.Clip(op.Sub(e, _const(fmt.emax)), _const(0), _const(254))


# ----------------------------------------------------------------------------- elements


def _magnitude_codes(y, fmt: MXFormat):
    """int32 magnitude codes of float32 `y = |x| * 2^(127 - b)`: saturate, find the binade
    k in [emin, emax] (`emin` for subnormals), round `y * 2^(mbits - k)` to nearest even."""
    y = op.Min(y, _const(fmt.max_value, np.float32))
    n = fmt.emax - fmt.emin  # binades above emin
    k = _const(fmt.emin)
    for j in reversed(range(n.bit_length())):
        cand = op.Add(k, _const(1 << j))
        k = op.Where(op.GreaterOrEqual(y, _pow2(op.Add(cand, _const(127)))), cand, k)
    scaled = op.Mul(y, _pow2(op.Sub(_const(127 + fmt.mbits), k)))
    rounded = _as_int(op.Round(scaled))
    return op.Add(rounded, op.Mul(op.Sub(k, _const(fmt.emin)), _const(1 << fmt.mbits)))


def _signed_codes(mag, x, fmt: MXFormat):
    """Codes with the sign of float32 `x` (sign bit; -0 included as `1 / -0 = -Inf`)."""
    zero = _const(0.0, np.float32)
    negative = op.Or(op.Less(x, zero), op.Less(op.Reciprocal(x), zero))
    if fmt.integer:  # two's complement byte
        return op.Where(negative, op.BitwiseAnd(op.Sub(_const(256), mag), _const(0xFF)), mag)
    return op.Where(negative, op.Add(mag, _const(fmt.sign_bit)), mag)


# ----------------------------------------------------------------------------- the ops


def _checked(check, *args) -> mx.BlockLayout:
    try:
        return check(*args)
    except InputError as exc:
        raise LoweringError(exc.what, backend="onnx", op=exc.op, fix=exc.fix) from exc


def _static_shape(value, fill: int) -> tuple[int, ...]:
    """The value's shape, with `fill` for dynamic dims (argument checks only)."""
    return tuple(d if isinstance(d, int) else fill for d in value.shape)


def _torch_dtype(dtype) -> torch.dtype | ir.DataType:
    dtype = ir.DataType(dtype)
    return _TORCH.get(dtype, dtype)


def mx_quantize(x, format: str, axis: int, scale_rule: str = "floor", block_size: int = 32):  # noqa: A002
    """(codes, scales) as uint8: `portable.mx.quantize` bit for bit (module docstring)."""
    shape = _static_shape(x, 2 * block_size if isinstance(block_size, int) else 1)
    lay = _checked(
        mx.check_quantize, shape, _torch_dtype(x.dtype), format, axis, scale_rule, block_size
    )
    fmt, ax = lay.fmt, lay.axis
    xf = x if x.dtype == F32 else _to_f32(x)  # exact upcast of bf16 / fp16
    blocks = op.Reshape(xf, _split_axis(xf, ax, [-1, lay.block_size]))  # [.., nb, bs, ..]
    magnitude = op.Abs(blocks)
    finite = op.Equal(op.Sub(blocks, blocks), _const(0.0, np.float32))  # Inf - Inf is NaN
    inf = _const(np.inf, np.float32)
    amax = op.ReduceMax(op.Where(finite, magnitude, inf), _const([ax + 1], np.int64), keepdims=1)
    special = op.Equal(amax, inf)  # the block holds NaN or +-Inf
    b = _scale_bytes(op.Where(special, _const(0.0, np.float32), amax), fmt, scale_rule)
    b = op.Where(special, _const(255), b)
    y = op.Mul(magnitude, op.Gather(_const(_reciprocal_table(), np.float32), b))
    codes = _signed_codes(_magnitude_codes(y, fmt), blocks, fmt)
    codes = op.Where(special, _const(0), codes)
    if fmt.packed:  # element 2i in the low nibble, 2i + 1 in the high one
        pairs = op.Reshape(codes, _split_axis(xf, ax, [-1, 2]))
        low = op.Gather(pairs, _const(0), axis=ax + 1)
        high = op.Gather(pairs, _const(1), axis=ax + 1)
        codes = op.Add(low, op.Mul(high, _const(16)))
    else:
        codes = op.Reshape(codes, op.Shape(xf))
    scales = op.Squeeze(b, _const([ax + 1], np.int64))
    return op.Cast(codes, to=U8), op.Cast(scales, to=U8)


def mx_dequantize(codes, scales, format: str, axis: int, dtype, block_size: int = 32):  # noqa: A002
    """Values in `dtype` (an ONNX type number): `portable.mx.dequantize` bit for bit, NaN
    payloads aside."""
    fill = block_size if isinstance(block_size, int) else 1
    out_dtype = _torch_dtype(dtype)
    lay = _checked(
        mx.dequantize_layout, _static_shape(codes, fill), format, axis, out_dtype, block_size
    )
    fmt, ax = lay.fmt, lay.axis
    table = decode_table(fmt)
    c = _as_int(codes)
    if fmt.packed:  # [.., L/2, ..] bytes -> [.., L/2, 2, ..] nibbles (low first)
        nibble_axis = _const([ax + 1], np.int64)
        low = op.Unsqueeze(op.BitwiseAnd(c, _const(0xF)), nibble_axis)
        high = op.Unsqueeze(op.Div(c, _const(16)), nibble_axis)
        c = op.Concat(low, high, axis=ax + 1)
        table = table[:16, 0]
    values = op.Gather(_const(table.numpy(), np.float32), c)
    values = op.Reshape(values, _split_axis(codes, ax, [-1, lay.block_size]))
    scale = op.Gather(_const(scale_values(torch.arange(256, dtype=torch.int32)).numpy(), np.float32),
                      _as_int(scales))  # fmt: skip
    values = op.Mul(values, op.Unsqueeze(scale, _const([ax + 1], np.int64)))
    values = op.Reshape(values, _split_axis(codes, ax, [-1]))
    if ir.DataType(dtype) != F32:
        values = op.Cast(values, to=ir.DataType(dtype))
    return values


def check_node(node: torch.fx.Node) -> None:
    """Raise the LoweringError, located at `node`, that exporting this MX node would raise (its
    arguments refused by `portable.mx`); nothing for other nodes. For a backend's program check
    before `torch.onnx.export`, which wraps errors raised inside translations."""
    if node.target not in TRANSLATIONS:
        return
    b = bind(node)
    try:
        if node.target is Q_OP:
            x = b.node("x").meta["tensor"]
            mx.check_quantize(
                x.shape, x.dtype, b.literal("format"), b.literal("axis"),
                b.literal("scale_rule"), b.literal("block_size"),
            )  # fmt: skip
        else:
            codes, scales = (
                torch.empty(b.node(k).meta["tensor"].shape, dtype=b.node(k).meta["tensor"].dtype,
                            device="meta")
                for k in ("codes", "scales")
            )  # fmt: skip
            mx.check_dequantize(
                codes, scales, b.literal("format"), b.literal("axis"), b.literal("dtype"),
                b.literal("block_size"),
            )  # fmt: skip
    except InputError as exc:
        src = source_of(node)
        raise LoweringError(
            exc.what,
            backend="onnx",
            op=op_name(node.target),
            module=src.module if src else None,
            source=src.location() if src else None,
            fix=exc.fix,
        ) from exc


TRANSLATIONS: dict[torch._ops.OpOverload, Callable] = {
    Q_OP: mx_quantize,
    DQ_OP: mx_dequantize,
}
