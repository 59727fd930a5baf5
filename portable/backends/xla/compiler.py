"""What the single-device (backend.py) and per-rank (spmd.py) paths share: the XLA compiler
options, and the texts of a lowered module. JAX is imported by the callers, not here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax

__all__ = ["COMPILER_OPTIONS", "compile_lowered", "lowered_texts", "row_major"]

# XLA:CPU's LLVM backend contracts a * b + c into one FMA at optimization levels > 0, so results
# round differently from PyTorch's kernels (which never contract) and values near 0 can change
# sign (a ReLU then routes a gradient the reference drops). Level 0 keeps every rounding of the
# HLO, and compiles the small parity programs faster.
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def compile_lowered(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered` compiled for XLA:CPU with COMPILER_OPTIONS."""
    return lowered.compile(compiler_options=COMPILER_OPTIONS)  # type: ignore[arg-type]  # jax says str | bool; jaxlib takes ints


def lowered_texts(lowered: jax.stages.Lowered) -> dict[str, str]:
    """The module as StableHLO and as HLO text, by file name (what `lower` shows and `write`
    writes)."""
    stablehlo = lowered.as_text()
    hlo = lowered.compiler_ir("hlo")
    assert hlo is not None  # None only for dialects a backend lacks; every module has HLO
    return {"graph.stablehlo.mlir": stablehlo, "graph.hlo.txt": hlo.as_hlo_text()}


def row_major(t):
    """`t` with row-major strides, size-1 dims included: torch calls a [3, 1] tensor of strides
    (1, 3) contiguous, while JAX reads a layout from the strides and refuses one the executable
    was not compiled for."""
    import torch

    t = t.detach()
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= max(size, 1)
    if tuple(reversed(expected)) == t.stride():
        return t
    return t.clone(memory_format=torch.contiguous_format)
