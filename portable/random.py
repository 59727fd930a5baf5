"""Random numbers that are part of the program: Threefry-2x32 written in the opset's integer ops.

Every backend computes the same bits from the same key because no backend RNG is involved: the
generator is ordinary int32 arithmetic in the graph, a pure function of its inputs (recomputing
it, as rematerialization does, gives the same mask).

Contract (all words are 32-bit values held in int32 tensors as two's-complement bit patterns):

- **Key.** `key(seed, offset)` for int64 0-d tensors `seed` and `offset` (program state) is
  `threefry2x32(words(seed), words(offset))`, where `words(v) = (v >> 32, v & 0xffffffff)`.
  `words(seed)` is `jax.random.PRNGKey(seed)`'s key data (x64), so the key is
  `threefry_2x32(PRNGKey(seed), [offset >> 32, offset & 0xffffffff])` in JAX's terms.
- **Bits.** `bits(key, stream, shape)[i] = y0 ^ y1` with `(y0, y1) = threefry2x32(key, (stream,
  i))` and `i` the element's row-major linear index over `shape` (at most 2^32 elements): the
  counter is the global index, so any slice of the tensor has its own bits. For stream 0 these
  are `jax.random.bits(key, shape, uint32)` (threefry, `jax_threefry_partitionable`).
- **Uniform.** the top `n` bits times 2^-n, in [0, 1) and exact: `n` is the dtype's significand
  width (24 for float32, 11 float16, 8 bfloat16, 31 for float64).
- **Dropout.** `keep = uniform_float32 >= p`, computed exactly as `bits >>> 8 >= ceil(p * 2^24)`
  (the same mask whatever the input dtype); `out = x * (keep * (1 / (1 - p)))` with the noise
  `keep * (1 / (1 - p))` rounded to x's dtype first, as `torch.native_dropout`'s CPU kernel
  computes it (bit for bit in float32, bfloat16 and float16); `p == 0` or not training: `x`;
  `p == 1`: `x * 0`, as torch (NaN stays NaN). Feature dropout masks (N, C) and broadcasts;
  alpha dropout uses torch's affine constants.

Arithmetic that every backend computes alike. int32 `add` and `mul` wrap modulo 2^32 (XLA
defines it; torch, ONNX Runtime, Triton and Neuron's int32 units do it); `xor` and `and` are
exact. No shift op is used (ONNX has none for signed integers): `x << r` is `x * 2^r`, and
`x >>> k` is `(x & bits k..31) / 2^k` with the sign extension masked off, split in two parts
below 2^16 where more than 24 bits would be divided. Every dividend is then a multiple of 2^k
with at most 24 significant bits, so the quotient is exact even where a backend divides
integers in float32 (the ONNX translation of `div` does). int64 appears only in `words()`, on
the 0-d seed and offset; Neuron computes int64 as int32, so there seeds and offsets must stay
below 2^31 (the validator warns `int64-downcast` on those few scalar ops).

Sharding. The counter is a sum of per-dim `arange`s over the global shape. Under a plan,
`spmd-partition` recomputes a replicated value at the local size by pushing the split to its
producers (passes/spmd/localize.py) and slices each `arange` with `local_shard`, which keeps the
global indices: every rank computes only its slice of the global mask, and data- or
tensor-parallel runs draw exactly the single-device run's mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .errors import InputError

__all__ = [
    "MAX_ELEMENTS",
    "Key",
    "apply_dropout",
    "bits",
    "dropout",
    "keep_mask",
    "key",
    "threefry2x32",
    "uniform",
]

MAX_ELEMENTS = 1 << 32  # the element counter is one 32-bit word
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's, as Random123 and JAX
_PARITY = 0x1BD11BDA  # the key schedule's third word is k0 ^ k1 ^ _PARITY
_ALPHA = 1.7580993408473766  # SELU's -alpha * scale: what alpha dropout sets dropped units to


class Key(NamedTuple):
    """A Threefry key: two int32 0-d tensors holding 32-bit words."""

    k0: torch.Tensor
    k1: torch.Tensor


def _as_i32(value: int) -> int:
    """The int32 whose bits are the low 32 bits of `value`."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _word(value: int, device: torch.device) -> torch.Tensor:
    """A 0-d int32 tensor holding the 32-bit word `value` (the opset's bitwise ops take
    tensors, not Python scalars)."""
    return torch.full((), _as_i32(value), dtype=torch.int32, device=device)


def _bits_between(lo: int, hi: int) -> int:
    """The mask of bits lo .. hi - 1."""
    return ((1 << hi) - 1) ^ ((1 << lo) - 1)


Words = Callable[[int], torch.Tensor]  # a word's 0-d tensor, made once per hash


def _words_on(device: torch.device) -> Words:
    return functools.cache(lambda value: _word(value, device))


def _srl(x: torch.Tensor, k: int, word: Words) -> torch.Tensor:
    """x >>> k (logical) for int32 words, 0 < k < 32, without shift ops.

    (x & bits k..31) is a multiple of 2^k: dividing it by 2^k is exact (trunc or floor alike)
    and an arithmetic shift; masking to 32 - k bits drops the sign extension. When more than 24
    bits would be divided, bits 16..31 and k..15 are divided apart (each below 2^16 significant
    bits), so a float32 division computes the same quotient."""
    split = 32 - k > 24
    top = _divided(x, 16 if split else k, 32, k, word) & word((1 << (32 - k)) - 1)
    return top + _divided(x, k, 16, k, word) if split else top


def _divided(x: torch.Tensor, lo: int, hi: int, k: int, word: Words) -> torch.Tensor:
    """(x & bits lo..hi-1) / 2^k, exact (the dividend is a multiple of 2^k)."""
    return torch.div(x & word(_bits_between(lo, hi)), 1 << k, rounding_mode="trunc")


def _rotl(x: torch.Tensor, r: int, word: Words) -> torch.Tensor:
    # rotl(x, r) = (x << r) | (x >>> (32 - r)); the two parts share no bit, so | is +
    return x * (1 << r) + _srl(x, 32 - r, word)


def threefry2x32(
    key: Key | tuple[torch.Tensor, torch.Tensor], counter: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Threefry-2x32 with 20 rounds (Random123's `threefry2x32_20`, JAX's `threefry_2x32`) of
    the int32 words `counter` (broadcast together) under `key`; returns the two output words."""
    k0, k1 = key
    word = _words_on(k0.device)
    ks = (k0, k1, k0 ^ k1 ^ word(_PARITY))
    x0, x1 = counter[0] + ks[0], counter[1] + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r, word) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + (i + 1)
    return x0, x1


def _words(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of an int64 0-d tensor, as int32. The high word is
    (bits 48..63 + bits 32..47) / 2^32, two exact divisions of at most 16 significant bits."""
    if value.dtype != torch.int64 or value.dim() != 0:
        raise InputError(
            f"a seed or offset must be an int64 0-d tensor, got {value.dtype} of shape "
            f"{tuple(value.shape)}",
            fix="register it as torch.tensor(n, dtype=torch.int64) (a buffer of the module)",
        )

    def masked(lo: int, hi: int) -> torch.Tensor:
        mask = _bits_between(lo, hi)
        signed = mask - (1 << 64) if mask >= 1 << 63 else mask
        return value & torch.full((), signed, dtype=torch.int64, device=value.device)

    def high(lo: int, hi: int) -> torch.Tensor:
        return torch.div(masked(lo, hi), 1 << 32, rounding_mode="trunc")

    return (high(48, 64) + high(32, 48)).to(torch.int32), masked(0, 32).to(torch.int32)


def key(seed: torch.Tensor, offset: torch.Tensor) -> Key:
    """The key of one program step: int64 0-d `seed` and `offset` hashed into two words."""
    return Key(*threefry2x32(_words(seed), _words(offset)))


def _counter(shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """Each element's row-major linear index over `shape` as an int32 word: a sum of per-dim
    `arange`s (broadcast), so a slice of any dim is an `arange` slice (see Sharding above)."""
    static = [d for d in shape if isinstance(d, int)]
    if len(static) == len(shape) and math.prod(static) > MAX_ELEMENTS:
        raise InputError(
            f"random numbers for {math.prod(static)} elements (shape {tuple(shape)}): the "
            f"counter is one 32-bit word, at most {MAX_ELEMENTS} elements",
            fix="draw the mask in pieces of at most 2^32 elements (split a dim)",
        )
    index: torch.Tensor | None = None
    stride = 1
    for d in reversed(range(len(shape))):
        n = shape[d]
        if not (isinstance(n, int) and n == 1):
            view = [1] * len(shape)
            view[d] = n
            term = torch.arange(n, dtype=torch.int32, device=device).view(view)
            if not (isinstance(stride, int) and stride == 1):
                term = term * (_as_i32(stride) if isinstance(stride, int) else stride)
            index = term if index is None else term + index
        stride = stride * n
    if index is None:  # one element (or a 0-d tensor)
        return torch.zeros(tuple(shape), dtype=torch.int32, device=device)
    return index


def bits(key: Key, stream: int, shape: Sequence[int]) -> torch.Tensor:
    """32 random bits per element of `shape` (an int32 tensor of bit patterns) for the random
    call site `stream` (a Python int below 2^32) under `key`."""
    if not 0 <= stream < 1 << 32:
        raise InputError(f"stream {stream} is not a 32-bit word", fix="number call sites from 0")
    device = key.k0.device
    y0, y1 = threefry2x32(key, (_word(stream, device), _counter(shape, device)))
    return y0 ^ y1


def uniform(
    seed: torch.Tensor,
    offset: torch.Tensor,
    stream: int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Uniform floats in [0, 1): the top `n` bits of `bits` times 2^-n, `n` the significand
    width of `dtype` (at most 31). Exact: every value is a multiple of 2^-n."""
    if not dtype.is_floating_point:
        raise InputError(f"uniform needs a floating-point dtype, got {dtype}")
    n = min(1 - round(math.log2(torch.finfo(dtype).eps)), 31)
    x = bits(key(seed, offset), stream, shape)
    top = _srl(x, 32 - n, _words_on(x.device))
    return top.to(dtype) * 2.0**-n


def keep_mask(key: Key, stream: int, shape: Sequence[int], p: float) -> torch.Tensor:
    """The bool mask dropout keeps: uniform (float32's 24 bits) >= p, compared exactly."""
    x = bits(key, stream, shape)
    return _srl(x, 8, _words_on(x.device)) >= math.ceil(p * (1 << 24))


def _check_p(p: float, what: str) -> None:
    if not 0.0 <= p <= 1.0:
        raise InputError(
            f"{what} probability has to be between 0 and 1, but got {p}",
            fix="pass p in [0, 1] (the fraction of elements zeroed)",
        )


def _feature_shape(x: torch.Tensor) -> tuple[int, ...]:
    """torch's feature-dropout noise shape: (N, C, 1, ..., 1)."""
    if x.dim() < 2:
        raise InputError(
            f"feature dropout needs at least 2 dims (N, C, ...), got shape {tuple(x.shape)}",
            fix="use dropout for 1-d inputs",
        )
    return (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2)


def apply_dropout(
    x: torch.Tensor,
    p: float,
    key: Key,
    stream: int,
    *,
    feature: bool = False,
    alpha: bool = False,
) -> torch.Tensor:
    """torch's `dropout` (`feature`: `feature_dropout`; `alpha`: `alpha_dropout`; both:
    `feature_alpha_dropout`) in training with 0 < p <= 1, the mask drawn from `(key, stream)`."""
    _check_p(p, "dropout")
    if not x.is_floating_point():
        raise InputError(f"dropout needs a floating-point tensor, got {x.dtype}")
    if p == 1:
        return x * 0.0  # torch: input * zeros({}), every variant
    keep = keep_mask(key, stream, _feature_shape(x) if feature else x.shape, p)
    noise = keep.to(x.dtype)
    if not alpha:
        return x * (noise * (1.0 / (1.0 - p)))  # torch's CPU native_dropout: the noise first
    # torch: a = 1 / sqrt((alpha^2 p + 1)(1 - p)); b = (noise - 1) * alpha * a + alpha * a * p
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    b = (noise - 1) * (_ALPHA * a) + _ALPHA * a * p
    return x * (noise * a) + b


def dropout(
    x: torch.Tensor,
    p: float,
    seed: torch.Tensor,
    offset: torch.Tensor,
    stream: int,
    training: bool = True,
) -> torch.Tensor:
    """Dropout with the counter-based mask of `(seed, offset, stream)`: `x * (keep / (1 - p))`
    (as `torch.native_dropout`); `x` itself when not training, for p == 0 and empty `x`."""
    _check_p(p, "dropout")
    if not training or p == 0 or x.numel() == 0:
        return x
    return apply_dropout(x, p, key(seed, offset), stream)
