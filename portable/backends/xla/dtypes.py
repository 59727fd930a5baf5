"""torch dtype <-> JAX dtype."""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax.typing import DTypeLike

from portable.errors import LoweringError

_TO_JAX = {
    torch.float64: jnp.float64,
    torch.float32: jnp.float32,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.bool: jnp.bool_,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
    torch.float8_e5m2: jnp.float8_e5m2,
}


def to_jax(dtype: torch.dtype) -> DTypeLike:
    try:
        return _TO_JAX[dtype]
    except KeyError:
        raise LoweringError(f"dtype {dtype} has no JAX equivalent", backend="xla") from None


def from_scalar_type(dtype: torch.dtype | None, default: DTypeLike) -> DTypeLike:
    """The JAX dtype of an optional torch `dtype=` argument."""
    return default if dtype is None else to_jax(dtype)
