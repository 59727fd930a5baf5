"""Trainium3's MX custom calls, as JAX functions: `QuantizeMX` and `__op$block_scaled_dot`.

Each call has two implementations chosen when the program is lowered (`impl`):

- "custom-call": the HLO custom call neuronx-cc takes (Neuron error-code pages NCC_EVRF036..058),
  emitted through a JAX primitive whose lowering writes a `stablehlo.custom_call` with
  api_version 1 (API_VERSION_ORIGINAL) and the JSON `backend_config` as a string, so the HLO
  proto's `custom_call_target` and `backend_config` are exactly the ones below. The JSON is
  written with sorted keys and no spaces: the bytes of graph.hlo are deterministic.
- "stand-in": JAX code computing exactly what the call is documented to compute, on XLA:CPU:
  the same operands, shapes and dtypes in and out, so a stand-in HLO has the structure of the
  custom-call HLO and runs here (parity tests; never a compiler input).

Contracts (the documented ones, and our assumptions, marked):

    QuantizeMX(x)                      x: bf16 / f16, rank >= 1
      backend_config {"block_size":32,"dim":d,"dtype":"float8_e4m3fn"|"float8_e5m2",
                      "scale_method":"EMAX"}       d: -1 or -2 (the last or second-to-last dim)
      -> (data: u32[x.shape, dim d / 4], scales: u8[x.shape, dim d / 32])
    The codes are `portable.mx.quantize(x, format, d, scale_rule="emax")`'s (EMAX: floor's
    scale doubled, shared/reference/neuron.md). ASSUMED: four consecutive codes along dim d in
    one u32, element 4i in the low byte (little-endian order); scales as u8 E8M0 bytes in
    `portable.mx`'s layout (the pages do not document the scale tensor's type or shape).

    __op$block_scaled_dot(lhs, rhs, lhs_scale, rhs_scale)    lhs, rhs: u32 data of QuantizeMX
      backend_config {"scaled_dot_backend_config":{"element_dtype":...,
                      "lhs_batch_dimensions":[...],"lhs_contracting_dimensions":[c],
                      "rhs_batch_dimensions":[...],"rhs_contracting_dimensions":[c']}}
      -> f32 or bf16: sum over the contracted dim of dq(lhs) * dq(rhs), dims ordered as
         dot_general's (batch, lhs free, rhs free).
    The stand-in decodes to the dtype the emulated program's dequantize produced (`decoded`)
    and runs the SAME dot as the `xla` rule of `aten.mm` (`rules._util.matmul`: operands in
    that dtype, accumulated in float32 at full precision), so it is bit-identical to the
    emulation. ASSUMED: the hardware's accumulation order and precision (only a device shows).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import mlir
from jax.extend.core import Primitive

from ..xla.rules import mx as mx_rules
from ..xla.rules._util import matmul
from .validate_mx import QUANTIZE_MX, SCALED_DOT

__all__ = [
    "ELEMENT_DTYPES",
    "IMPLS",
    "QUANTIZE_MX",
    "SCALED_DOT",
    "block_scaled_dot",
    "dot_config",
    "quantize_config",
    "quantize_mx",
]

IMPLS = ("custom-call", "stand-in")
BLOCK = 32
PACK = 4  # FP8 codes per u32
# portable.mx format -> the `dtype` / `element_dtype` the compiler names
ELEMENT_DTYPES = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
_FORMATS = {v: k for k, v in ELEMENT_DTYPES.items()}


def _json(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def quantize_config(dim: int, fmt: str) -> str:
    """QuantizeMX's backend_config for quantizing along `dim` (-1 or -2) to `fmt`."""
    return _json(
        {"block_size": BLOCK, "dim": dim, "dtype": ELEMENT_DTYPES[fmt], "scale_method": "EMAX"}
    )


def dot_config(
    fmt: str,
    contracting: tuple[int, int],
    batch: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
) -> str:
    """__op$block_scaled_dot's backend_config: contracting dim of lhs and rhs, batch dims."""
    inner = {
        "element_dtype": ELEMENT_DTYPES[fmt],
        "lhs_batch_dimensions": list(batch[0]),
        "lhs_contracting_dimensions": [contracting[0]],
        "rhs_batch_dimensions": list(batch[1]),
        "rhs_contracting_dimensions": [contracting[1]],
    }
    return _json({"scaled_dot_backend_config": inner})


def _shape_along(shape: tuple[int, ...], dim: int, divisor: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] //= divisor
    return tuple(out)


# ---------------------------------------------------------------------- the custom-call primitives

_quantize_p = Primitive("neuron_quantize_mx")
_quantize_p.multiple_results = True
_dot_p = Primitive("neuron_block_scaled_dot")


def _quantize_abstract(x, *, dim, fmt):
    return (
        jax.core.ShapedArray(_shape_along(x.shape, dim, PACK), jnp.uint32),
        jax.core.ShapedArray(_shape_along(x.shape, dim, BLOCK), jnp.uint8),
    )


def _dot_abstract(lhs, rhs, lhs_scale, rhs_scale, *, config, out_shape, out_dtype):
    return jax.core.ShapedArray(out_shape, out_dtype)


def _quantize_lowering(ctx, x, *, dim, fmt):
    types = [mlir.aval_to_ir_type(ctx.module_context, a) for a in ctx.avals_out]
    op = mlir.custom_call(
        QUANTIZE_MX,
        result_types=types,
        operands=[x],
        backend_config=quantize_config(dim, fmt),
        api_version=1,
    )
    return op.results


def _dot_lowering(ctx, lhs, rhs, lhs_scale, rhs_scale, *, config, out_shape, out_dtype):
    (aval,) = ctx.avals_out
    op = mlir.custom_call(
        SCALED_DOT,
        result_types=[mlir.aval_to_ir_type(ctx.module_context, aval)],
        operands=[lhs, rhs, lhs_scale, rhs_scale],
        backend_config=config,
        api_version=1,
    )
    return op.results


_quantize_p.def_abstract_eval(_quantize_abstract)
_dot_p.def_abstract_eval(_dot_abstract)
mlir.register_lowering(_quantize_p, _quantize_lowering)
mlir.register_lowering(_dot_p, _dot_lowering)


# ---------------------------------------------------------------------- the calls


def quantize_mx(x: jax.Array, dim: int, fmt: str, impl: str) -> tuple[jax.Array, jax.Array]:
    """QuantizeMX of bf16/f16 `x` along `dim` (-1 or -2) to `fmt` (e4m3 / e5m2): (u32 data,
    u8 scales) as the module docstring states, as a custom call or its stand-in."""
    if impl == "custom-call":
        data, scales = _quantize_p.bind(x, dim=dim, fmt=fmt)
        return data, scales
    codes, scales = mx_rules.quantize(x, fmt, dim % x.ndim, "emax", BLOCK)
    return pack(codes, dim % x.ndim), scales


def block_scaled_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_scale: jax.Array,
    rhs_scale: jax.Array,
    *,
    fmt: str,
    contracting: tuple[int, int],
    out_dtype: Any,
    decoded: Any,
    impl: str,
) -> jax.Array:
    """The 2-D block-scaled dot of QuantizeMX outputs contracting dim `contracting[0]` of lhs
    with `contracting[1]` of rhs: [lhs free, rhs free] in `out_dtype` (f32 / bf16). The
    stand-in decodes each operand to `decoded` and runs the `xla` rule's matmul."""
    if lhs.ndim != 2 or rhs.ndim != 2:
        raise ValueError(f"block_scaled_dot here is 2-D; got ranks {lhs.ndim}, {rhs.ndim}")
    if impl == "custom-call":
        free = (lhs.shape[1 - contracting[0]], rhs.shape[1 - contracting[1]])
        config = dot_config(fmt, contracting)
        return _dot_p.bind(
            lhs,
            rhs,
            lhs_scale,
            rhs_scale,
            config=config,
            out_shape=free,
            out_dtype=jnp.dtype(out_dtype),
        )
    a = decode(lhs, lhs_scale, contracting[0], fmt, decoded)
    b = decode(rhs, rhs_scale, contracting[1], fmt, decoded)
    a = a if contracting[0] == 1 else a.T  # [M, K]
    b = b if contracting[1] == 0 else b.T  # [K, N]
    return matmul(a, b, out_dtype)


# ---------------------------------------------------------------------- packing (the assumption)


def pack(codes: jax.Array, dim: int) -> jax.Array:
    """u8 codes -> u32, four consecutive codes along `dim` per word, element 4i in the low byte."""
    shape = codes.shape
    split = shape[:dim] + (shape[dim] // PACK, PACK) + shape[dim + 1 :]
    c = codes.astype(jnp.uint32).reshape(split)
    parts = [lax.index_in_dim(c, i, dim + 1, keepdims=False) << (8 * i) for i in range(PACK)]
    return functools.reduce(lax.bitwise_or, parts)


def unpack(data: jax.Array, dim: int) -> jax.Array:
    """The inverse of `pack`: u32 words -> u8 codes, dim `dim` four times longer."""
    parts = [((data >> (8 * i)) & 0xFF).astype(jnp.uint8) for i in range(PACK)]
    stacked = jnp.stack(parts, axis=dim + 1)
    shape = data.shape
    return stacked.reshape(shape[:dim] + (shape[dim] * PACK,) + shape[dim + 1 :])


def decode(data: jax.Array, scales: jax.Array, dim: int, fmt: str, dtype: Any) -> jax.Array:
    """The values QuantizeMX's (data, scales) along `dim` stand for, in `dtype`:
    `portable.mx.dequantize` of the unpacked codes, bit for bit."""
    return mx_rules.dequantize(unpack(data, dim), scales, fmt, dim, dtype, BLOCK)


def pack_numpy(codes: np.ndarray, dim: int) -> np.ndarray:
    """`pack` in NumPy (tests and tools): u8 codes -> u32 words along `dim`."""
    moved = np.moveaxis(codes.astype(np.uint32), dim, -1)
    words = moved.reshape(*moved.shape[:-1], -1, PACK)
    packed = np.zeros(words.shape[:-1], np.uint32)
    for i in range(PACK):
        packed |= words[..., i] << np.uint32(8 * i)
    return np.moveaxis(packed, -1, dim)


def format_of(element_dtype: str) -> str | None:
    """The portable.mx format of a compiler element dtype name (None if not an MX FP8 one)."""
    return _FORMATS.get(element_dtype)
