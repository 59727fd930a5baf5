"""`portable::mx_quantize` / `portable::mx_dequantize`: the bytes of `portable.mx`, on every target.

Contract. `mx_quantize(x, format, axis, scale_rule, block_size)` returns exactly the
`(codes, scales)` of `portable.mx.quantize` (shared/reference/mx.md) for every format (E4M3,
E5M2, E3M2, E2M3, E2M1 packed two per byte with element 2i in the low nibble, MXINT8), every
scale rule (floor, rceil, ceil, even, emax), any axis and block size, float32 / bfloat16 / float16
input (the bytes of the exact float32 upcast), NaN / Inf blocks (scale 255, zero codes) and
zero blocks. `mx_dequantize` returns exactly the values of `portable.mx.dequantize` in float32,
bfloat16, float16 (or float64 on `xla`), NaN payloads aside. Arguments are checked by
`portable.mx` (a LoweringError carries its message and fix). The same rules lower for `xla`
and `neuron`.

Integers only. XLA:CPU flushes subnormal results of float arithmetic to zero (and a compiler
may contract or reorder float ops), so no float operation decides a bit here: floats are read
and written as bit patterns (`bitcast-convert`) and everything in between is int32 arithmetic:
and / or / xor, add / subtract, shifts, compare / select, maximum / minimum and one int32
reduce-max per block. Subnormals are normalized by a binary search of shifts (`leading_one`),
not `count-leading-zeros`, which is not on Neuron's opcode list. No FP8 / FP4 element type and
no custom call appears in the HLO; float64 output (xla only: neuron lowers it as float32) is
assembled in int64.

Numbers. A finite fp32 magnitude with bits `a` is `sig * 2^(e - 150)`, `sig` in [2^23, 2^24)
(0 for zero) after `normalize`.

- Scale byte (as `portable.mx.scale`), from the block amax bits (int32 order: NaN > Inf > finite):
  floor, ceil, even and emax read the exponent field (emax: one less below 2^-127, so that an
  MXINT8 block with a tiny amax gets 0, as by its value). rceil is `C(d)`, `d = fp32(amax *
  fp32(1/max))`, C = the smallest byte b with `2^(b - 127) >= d`; d is never formed (it may be
  subnormal). The exact product is `P * 2^(Q - 127 - L)` with `P = sig(amax) * sig(1/max)`, a
  48-bit integer in [2^L, 2^(L+1)), and `Q = L + e(amax) + e(1/max) - 173` its biased exponent.
  Powers of two are even fp32 values, so d rounds to at most 2^(Q - 127) iff P is at most the
  midpoint to the next fp32 value, `2^L + 2^(L-24)` (`2^L + 2^(L-23)` for Q = 0, the subnormal
  binade): C is Q, plus one above it, and 0 for Q < 0. As `sa * sc > X` iff `sa > X // sc`, both
  tests compare sig(amax) with integer constants computed here: no 48-bit product either.
- Elements: `y = x * 2^(127 - b)` has exponent `k = e - b - emin` relative to 2^emin; the code is
  `(max(k, 0) << mbits) + rne(sig >> (23 - mbits + max(-k, 0)))` saturated to the largest code
  (the rounding carry bumps the exponent), sign from the input's sign bit (MXINT8: two's
  complement); blocks with b = 255 get zero codes.
- Dequantize: `element * 2^(b - 127)` is `+-sig * 2^exp` with sig <= 2^7, assembled directly in
  the output format: exact when normal, rounded to nearest even when subnormal (the reference's
  fp32 product is exact, so this is its one rounding), +-Inf from 2^128 (the fp32 product's
  overflow) or beyond the format's range; NaN for scale 255 and NaN codes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax
from jax.typing import DTypeLike

from portable import mx
from portable.errors import InputError
from portable.mx.formats import MXFormat

from ..dtypes import to_jax
from . import RULES
from ._util import unsupported

__all__ = ["MX_OPS", "dequantize", "quantize"]

MX_OPS = ("portable.mx_quantize.default", "portable.mx_dequantize.default")

I32 = jnp.int32
ABS_MASK = 0x7FFFFFFF
INF_BITS = 0x7F800000
HIDDEN = 0x800000  # the implicit leading one of a normal fp32 significand
SCALE_MIN_BITS = 0x400000  # 2^-127
_TORCH_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                 torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)  # fmt: skip

# output float formats: (mantissa bits, exponent bias, width, quiet NaN bits, integer type)
_OUTPUT = {
    jnp.dtype(jnp.float32): (23, 127, 32, 0x7FC00000, jnp.int32),
    jnp.dtype(jnp.bfloat16): (7, 127, 16, 0x7FC0, jnp.int32),
    jnp.dtype(jnp.float16): (10, 15, 16, 0x7E00, jnp.int32),
    jnp.dtype(jnp.float64): (52, 1023, 64, 0x7FF8 << 48, jnp.int64),
}
_FP32_OVERFLOW = 128  # dequantize computes in fp32: 2^128 and above is +-Inf in every dtype


# ----------------------------------------------------------------------------- bit helpers


def select(cond, a, b):
    """`a` where `cond`, else `b`, broadcast; Python ints become constants of the arrays' integer
    type (int32 when both are ints: under x64 they would be int64). A flat HLO `select`:
    `jnp.where` would add a called computation with int64 scalar parameters."""
    arrays = [v for v in (a, b) if not isinstance(v, int)]
    dtype = arrays[0].dtype if arrays else I32
    shape = jnp.broadcast_shapes(cond.shape, *(v.shape for v in arrays))
    a, b = (jnp.broadcast_to(jnp.asarray(v, dtype), shape) for v in (a, b))
    return lax.select(jnp.broadcast_to(cond, shape), a, b)


def clamp(x: jax.Array, lo: int, hi: int) -> jax.Array:
    return lax.clamp(jnp.asarray(lo, x.dtype), x, jnp.asarray(hi, x.dtype))


def fp32_bits(x):
    """int32 bits of the exact float32 value of float32 / bfloat16 / float16 `x`."""
    if x.dtype == jnp.float32:
        return lax.bitcast_convert_type(x, I32)
    half = lax.bitcast_convert_type(x, jnp.uint16).astype(I32)
    if x.dtype == jnp.bfloat16:
        return half << 16
    # float16: sign | exponent (bias 15 -> 127) | mantissa (10 -> 23 bits); subnormals normalized
    sign = (half >> 15) << 31
    e, m = (half >> 10) & 0x1F, half & 0x3FF
    n = 10 - leading_one(m, 10)  # puts a subnormal's leading one on bit 10
    normal = ((e + 112) << 23) | (m << 13)
    special = INF_BITS | (m << 13)
    subnormal = ((113 - n) << 23) | (((m << n) & 0x3FF) << 13)
    magnitude = select(e == 31, special, select(e > 0, normal, subnormal))
    return sign | select((half & 0x7FFF) == 0, 0, magnitude)


def leading_one(m: jax.Array, width: int) -> jax.Array:
    """Position of the highest set bit of int32 `0 < m < 2^width` (0 for m = 0), by a binary
    search of shifts, compares and selects (HLO count-leading-zeros is not on Neuron's list)."""
    p = jnp.zeros_like(m)
    step = 1 << (max(width - 1, 1).bit_length() - 1)  # the largest power of two below width
    while step:
        upper = m >> step
        hit = upper > 0
        m, p = select(hit, upper, m), select(hit, p + step, p)
        step >>= 1
    return p


def normalize(a):
    """(e, sig) of finite fp32 magnitude bits `a`: `a`'s value is `sig * 2^(e - 150)` with sig in
    [2^23, 2^24), or sig = 0 (and e = -22) for zero."""
    e, m = a >> 23, a & 0x7FFFFF
    n = 23 - leading_one(m, 23)  # 1..23: puts a subnormal's leading one on bit 23
    return select(e > 0, e, 1 - n), select(e > 0, m | HIDDEN, m << n)


def rne_shift(sig, s):
    """`sig / 2^s` rounded to nearest, ties to even, for 0 <= sig < 2^30 and s >= 1 (capped at
    30: every such sig rounds to 0 or 1 there, and the sum below stays within int32)."""
    s = jnp.minimum(s, 30)
    half = (jnp.ones_like(s) << (s - 1)) - 1
    return (sig + half + ((sig >> s) & 1)) >> s


# ----------------------------------------------------------------------------- scale bytes


def _ceil_byte(bits):
    """Smallest b with 2^(b - 127) >= v, for the bits of finite v >= 0 (as portable.mx.scale)."""
    return select(bits < HIDDEN, (bits > 0x400000).astype(I32), (bits + 0x7FFFFF) >> 23)


def _rceil_byte(amax: jax.Array, fmt: MXFormat) -> jax.Array:
    """C(fp32(amax * fp32(1/max))) from integer comparisons (module docstring), at most 254."""
    inv = fmt.inv_max_bits
    ec, sc = inv >> 23, (inv & 0x7FFFFF) | HIDDEN
    e, sa = normalize(amax)
    big = sa >= -(-(1 << 47) // sc)  # P >= 2^47: L = 47, else L = 46

    def above(extra: int) -> jax.Array:  # P > 2^L + 2^(L - 24 + extra)
        limit47, limit46 = (((1 << L) + (1 << (L - 24 + extra))) // sc for L in (47, 46))
        return sa > select(big, limit47, limit46)

    q = e + ec - 173 + select(big, 47, 46)  # Q: the product's biased exponent field
    c = select(q >= 1, q + above(0).astype(I32), select(q == 0, above(1).astype(I32), 0))
    return jnp.minimum(c, 254)


def scale_bytes(amax: jax.Array, fmt: MXFormat, rule: str) -> jax.Array:
    """int32 E8M0 bytes (0..255) of blocks whose |x| maximum has the int32 fp32 bits `amax`."""
    if rule == "floor":
        b = (amax >> 23) - fmt.emax
    elif rule == "ceil":
        b = _ceil_byte(amax) - fmt.emax
    elif rule == "emax":  # F(amax) - emax + 1, F = floor(log2) + 127 (Trainium3's "EMAX")
        b = (amax >> 23) - (amax < SCALE_MIN_BITS).astype(I32) - (fmt.emax - 1)
    elif rule == "even":  # round amax to mbits mantissa bits (ties up; a subnormal by its value)
        inc = select(amax < HIDDEN, 1 << (21 - fmt.mbits), 1 << (22 - fmt.mbits))
        b = ((amax + inc) >> 23) - fmt.emax
    elif rule == "rceil":
        b = _rceil_byte(amax, fmt)
    else:
        raise ValueError(rule)
    return select(amax >= INF_BITS, 255, clamp(b, 0, 254))


# ----------------------------------------------------------------------------- elements


def encode(x_bits: jax.Array, b: jax.Array, fmt: MXFormat) -> jax.Array:
    """int32 codes (0..255) of int32 fp32 bits `x_bits` under (broadcast) scale bytes `b`."""
    e, sig = normalize(x_bits & ABS_MASK)
    k = e - b - fmt.emin  # binade of |x| * 2^(127 - b) relative to 2^emin
    r = rne_shift(sig, jnp.minimum(23 - fmt.mbits + jnp.maximum(-k, 0), 25))
    mag = jnp.minimum((jnp.maximum(k, 0) << fmt.mbits) + r, fmt.max_code)
    if fmt.integer:  # two's complement: (mag ^ s) - s with s = 0 or -1
        neg = x_bits >> 31
        code = ((mag ^ neg) - neg) & 0xFF
    else:  # the sign bit lands on bit (bits - 1) by an arithmetic shift
        code = mag | ((x_bits >> (32 - fmt.bits)) & fmt.sign_bit)
    return select(b == 255, 0, code)


def decode(
    code: jax.Array, fmt: MXFormat
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(negative, sig, exp, inf, nan) of int32 codes: the element is +-sig * 2^exp (bits above
    the code width ignored; MXINT8 bytes are int8 / 64)."""
    if fmt.integer:
        v = (code ^ 0x80) - 0x80
        false = jnp.zeros(code.shape, jnp.bool_)
        return v < 0, jnp.abs(v), jnp.full(code.shape, -6, I32), false, false
    c = code & ((1 << fmt.bits) - 1)
    mag = c & (fmt.sign_bit - 1)
    e, m = mag >> fmt.mbits, mag & ((1 << fmt.mbits) - 1)
    sig = select(e > 0, m | (1 << fmt.mbits), m)
    exp = jnp.maximum(e, 1) - (fmt.bias + fmt.mbits)
    inf = nan = jnp.zeros(code.shape, jnp.bool_)
    if fmt.specials == "nan":  # E4M3: magnitude 0x7F
        nan = mag == fmt.sign_bit - 1
    elif fmt.specials == "inf+nan":  # E5M2: exponent field all ones
        top = e == (1 << (fmt.bits - 1 - fmt.mbits)) - 1
        inf, nan = top & (m == 0), top & (m != 0)
    return c >= fmt.sign_bit, sig, exp, inf, nan


def float_bits(negative, sig, exp, inf, nan, dtype):
    """Bits of `+-sig * 2^exp` (0 <= sig < 2^8) in float `dtype`, as its same-width integer:
    exact when normal, round to nearest even when subnormal, +-Inf at 2^128 or beyond the
    format's range, quiet NaN where `nan`."""
    mbits, bias, width, nan_bits, itype = _OUTPUT[jnp.dtype(dtype)]
    top = (1 << (width - 1 - mbits)) - 1  # exponent field of Inf / NaN
    p = leading_one(sig, 8)  # sig <= 2^7 after a decode: p <= 7 <= mbits, no rounding if normal
    u = p + exp  # unbiased exponent of the value
    t = exp - 1 + bias + mbits  # value / 2^(1 - bias - mbits): sig << t
    small = rne_shift(sig, clamp(-t, 1, 30)).astype(itype)
    subnormal = select(t >= 0, sig.astype(itype) << clamp(t, 0, 30).astype(itype), small)
    field = (u + bias).astype(itype)
    normal = ((field - 1) << mbits) + (sig.astype(itype) << (mbits - p).astype(itype))
    bits = select(field >= 1, normal, subnormal)
    overflow = inf | (u >= min(_FP32_OVERFLOW, top - bias))
    bits = select(overflow, jnp.asarray(top, itype) << mbits, bits)
    bits = select(sig == 0, 0, bits)  # an Inf code has sig != 0
    bits = bits | (negative.astype(itype) << (width - 1))
    return select(nan, jnp.asarray(nan_bits, itype), bits)


def _as_float(bits, dtype):
    if jnp.dtype(dtype).itemsize == 2:
        return lax.bitcast_convert_type(bits.astype(jnp.uint16), dtype)
    return lax.bitcast_convert_type(bits, dtype)


# ----------------------------------------------------------------------------- the ops


def _torch_dtype(dtype: DTypeLike) -> torch.dtype:
    return {jnp.dtype(to_jax(d)): d for d in _TORCH_DTYPES}[jnp.dtype(dtype)]


def _blocks(lay: mx.BlockLayout, per_block: int) -> tuple[int, int, int, int]:
    """[outer, blocks along the axis, per_block, inner]: the tensor's row-major order."""
    return (lay.outer, lay.blocks_per_axis, per_block, lay.inner)


def quantize(
    x: jax.Array, format: str, axis: int, scale_rule: str = "floor", block_size: int = 32
) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) as uint8 JAX arrays: `portable.mx.quantize` bit for bit."""
    lay = mx.check_quantize(x.shape, _torch_dtype(x.dtype), format, axis, scale_rule, block_size)
    fmt, bs = lay.fmt, lay.block_size
    x_bits = fp32_bits(x).reshape(_blocks(lay, bs))
    amax = jnp.max(x_bits & ABS_MASK, axis=2, keepdims=True)
    b = scale_bytes(amax, fmt, scale_rule)
    codes = encode(x_bits, b, fmt)
    if fmt.packed:  # element 2i in the low nibble, 2i + 1 in the high one
        pairs = codes.reshape(lay.outer, lay.blocks_per_axis, bs // 2, 2, lay.inner)
        codes = pairs[:, :, :, 0, :] | (pairs[:, :, :, 1, :] << 4)
    codes = codes.astype(jnp.uint8).reshape(lay.codes_shape)
    return codes, b.astype(jnp.uint8).reshape(lay.scales_shape)


def dequantize(
    codes: jax.Array,
    scales: jax.Array,
    format: str,
    axis: int,
    dtype: DTypeLike,
    block_size: int = 32,
) -> jax.Array:
    """Values in JAX `dtype` (float32, bfloat16, float16, float64): `portable.mx.dequantize`
    bit for bit, NaN payloads aside."""
    codes_meta, scales_meta = (
        torch.empty(t.shape, dtype=_torch_dtype(t.dtype), device="meta") for t in (codes, scales)
    )
    lay = mx.check_dequantize(
        codes_meta, scales_meta, format, axis, _torch_dtype(dtype), block_size
    )
    fmt, bs = lay.fmt, lay.block_size
    c = codes.astype(I32).reshape(_blocks(lay, bs // 2 if fmt.packed else bs))
    if fmt.packed:
        c = jnp.stack([c & 0xF, c >> 4], axis=3).reshape(_blocks(lay, bs))
    b = scales.astype(I32).reshape(_blocks(lay, 1))
    negative, sig, exp, inf, nan = decode(c, fmt)
    bits = float_bits(negative, sig, exp + b - 127, inf, nan | (b == 255), dtype)
    return _as_float(bits, dtype).reshape(lay.shape)


def _checked(ctx, fn, *args):
    try:
        return fn(*args)
    except InputError as exc:
        raise unsupported(ctx, exc.what, exc.fix or "see portable.mx") from exc


@RULES.register(MX_OPS[0])
def mx_quantize(ctx, x, format, axis, scale_rule="floor", block_size=32):  # noqa: A002
    return _checked(ctx, quantize, x, format, axis, scale_rule, block_size)


@RULES.register(MX_OPS[1])
def mx_dequantize(ctx, codes, scales, format, axis, dtype, block_size=32):  # noqa: A002
    return _checked(ctx, dequantize, codes, scales, format, axis, to_jax(dtype), block_size)
