"""Helpers shared by rule modules: result dtypes, torch-style dims, accumulation and matmul.

Conventions the rules rely on:
- a node's recorded result dtype (`out_dtype`) already encodes torch's type promotion, so rules
  cast operands to it instead of re-deriving promotion;
- torch computes float16/bfloat16 kernels in float32 ("opmath") and rounds once at the end
  (`opmath`); rules that chain several operations do the same;
- float32 matmuls and convolutions are exact float32 (`PRECISION`), never a reduced-precision pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import torch
import torch.fx

from portable.errors import LoweringError
from portable.ir.signature import TensorSpec
from portable.ir.source import source_of
from portable.opset import op_name

from ..dtypes import to_jax

if TYPE_CHECKING:
    from jax.typing import DTypeLike

    from . import RuleContext

PRECISION = jax.lax.Precision.HIGHEST
_HALF = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _spec(ctx: RuleContext, index: int) -> TensorSpec:
    out = ctx.out
    spec = out[index] if isinstance(out, tuple) else out
    if not isinstance(spec, TensorSpec):
        raise ValueError(f"{ctx.node.name} has no recorded tensor result {index}")
    return spec


def out_dtype(ctx: RuleContext, index: int = 0) -> DTypeLike:
    """The JAX dtype of the node's (index-th) recorded result."""
    return to_jax(_spec(ctx, index).dtype)


def out_shape(ctx: RuleContext, index: int = 0) -> tuple[int, ...]:
    """The static shape of the node's (index-th) recorded result."""
    return tuple(int(d) for d in _spec(ctx, index).shape)


def as_array(value, dtype):
    """A tensor or Python scalar as a JAX array of `dtype` (torch computes in the result dtype)."""
    return jnp.asarray(value, dtype=dtype) if not hasattr(value, "dtype") else value.astype(dtype)


def opmath(dtype):
    """The dtype torch computes a `dtype` kernel in: float32 for float16/bfloat16, else itself."""
    return jnp.float32 if jnp.dtype(dtype) in _HALF else dtype


def scalar_like(value, like):
    """`value` as a 0-d array of `like`'s dtype (a bare Python float would enter jnp.where as
    float64, which neuron lacks)."""
    return jnp.asarray(value, like.dtype)


def opmath_unary(fn):
    """A rule computing the float kernel `fn` in opmath (float32 for bfloat16/float16) and
    rounding once to the recorded result dtype."""

    def rule(ctx, x):
        dtype = out_dtype(ctx)
        return fn(as_array(x, opmath(dtype))).astype(dtype)

    return rule


def opmath_binary(fn):
    """`opmath_unary` for a two-operand kernel on the promoted dtype."""

    def rule(ctx, x, y):
        dtype = out_dtype(ctx)
        compute = opmath(dtype)
        return fn(as_array(x, compute), as_array(y, compute)).astype(dtype)

    return rule


def rounded(x, dtype):
    """`x` (opmath) rounded to `dtype`'s precision and kept in x's dtype: where torch's kernel
    stores an intermediate in a half type. A convert pair would not do: XLA drops the
    intermediate rounding of f32 -> bf16 -> f32 (excess precision); `reduce_precision` stays."""
    if jnp.dtype(dtype) not in _HALF:
        return x
    info = jnp.finfo(dtype)
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def dim_list(dims: int | Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """Normalize torch's dim argument (int, list, or None / [] = all) to non-negative ints. A
    0-d tensor accepts dims 0 and -1 and has nothing to reduce over: ()."""
    if rank == 0:
        return ()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(d % rank for d in dims)


def norm_dim(dim: int, rank: int) -> int:
    """One (possibly negative) dim as a non-negative int; 0-d tensors accept dims 0 and -1."""
    return dim % rank if rank else 0


def reduce_sum(x: jax.Array, dims: tuple[int, ...], keepdim: bool, dtype: DTypeLike) -> jax.Array:
    """torch.sum: accumulate in opmath (float32 for half types), round to `dtype` once."""
    acc = opmath(dtype)
    return jnp.sum(x.astype(acc), axis=dims, keepdims=keepdim).astype(dtype)


def reduce_mean(x: jax.Array, dims: tuple[int, ...], keepdim: bool, dtype: DTypeLike) -> jax.Array:
    """torch.mean on CPU: sum(x) / n in opmath (float32 for half types), rounded to `dtype` once
    (the sum is not rounded before the division: measured against torch's kernel)."""
    n = math.prod(x.shape[d] for d in dims)
    acc = opmath(dtype)
    return (reduce_sum(x, dims, keepdim, acc) / jnp.asarray(n, acc)).astype(dtype)


def matmul(x, y, dtype):
    """x @ y (numpy batch rules) accumulated in opmath at full precision, rounded to `dtype`."""
    acc = opmath(dtype)
    out = jnp.matmul(
        x.astype(dtype), y.astype(dtype), precision=PRECISION, preferred_element_type=acc
    )
    return out.astype(dtype)


def pair(value: int | Sequence[int], n: int = 2) -> tuple[int, ...]:
    """torch's `int[2]` arguments: an int or a one-element list means the same value `n` times."""
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    return value * n if len(value) == 1 else value


def unsupported(ctx: RuleContext, what: str, fix: str) -> LoweringError:
    """A LoweringError for an argument combination a rule does not lower, located at the node."""
    src = source_of(ctx.node)
    return LoweringError(
        what,
        backend=ctx.platform,
        op=op_name(ctx.node.target),
        module=src.module if src else None,
        source=src.location() if src else None,
        fix=fix,
    )


def torch_result_dtype(ctx, *operands):
    """torch.result_type of a node's operands (graph values or Python scalars), for ops whose
    result dtype is not the computation dtype (comparisons). Uses the operands' recorded specs:
    0-d tensors and Python scalars promote only across categories (int -> float), as in torch."""

    def probe(value, arg):
        if isinstance(arg, torch.fx.Node):
            spec = arg.meta["tensor"]
            return torch.empty((1,) * len(spec.shape) if spec.shape else (), dtype=spec.dtype)
        return value

    args = ctx.node.args
    return to_jax(torch.result_type(*(probe(v, a) for v, a in zip(operands, args, strict=False))))
