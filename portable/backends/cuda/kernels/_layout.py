"""Shape arithmetic shared by the kernel plans: strides of contiguous tensors, broadcast strides
(stride 0 on broadcast dims) and the Triton integer type of runtime sizes.

Launchers make their inputs contiguous, so every stride a kernel reads follows from shapes alone:
a plan computes the same numbers from fake or meta tensors that the launcher passes at run time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["broadcast_strides", "contiguous_strides", "int_type", "merge_dims", "next_pow2"]

_I32_MAX = 2**31 - 1


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def broadcast_strides(shape: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """Strides that read a contiguous tensor of `shape` as if broadcast to `target` (aligned on
    the right; 0 on every dim `shape` lacks or has size 1). `shape` must broadcast to `target`."""
    own = contiguous_strides(shape)
    pad = len(target) - len(shape)
    out = []
    for i, size in enumerate(target):
        j = i - pad
        out.append(own[j] if j >= 0 and shape[j] == size and size != 1 else 0)
    return tuple(out)


def merge_dims(sizes: Sequence[int], *strides: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every stride list walks as one dim
    (stride[i] == stride[i + 1] * size[i + 1]). Returns the new sizes and stride lists."""
    keep = [i for i, size in enumerate(sizes) if size != 1]
    out_sizes: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for i in keep:
        mergeable = bool(out_sizes) and all(
            out[-1] == s[i] * sizes[i] for out, s in zip(out_strides, strides, strict=True)
        )
        if mergeable:
            out_sizes[-1] *= sizes[i]
            for out, s in zip(out_strides, strides, strict=True):
                out[-1] = s[i]
        else:
            out_sizes.append(int(sizes[i]))
            for out, s in zip(out_strides, strides, strict=True):
                out.append(int(s[i]))
    return out_sizes, out_strides


def int_type(*values: int) -> str:
    """The Triton type the JIT gives these runtime ints: "i32", or "i64" when one is too big."""
    return "i32" if all(-(2**31) <= int(v) <= _I32_MAX for v in values) else "i64"


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(int(n), 1))))
