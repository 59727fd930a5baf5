"""The ops that run as Triton kernels on `cuda`: launchers, planners and the kernel-graph ops.

A launcher (`mx_quantize`, `scale_mask_softmax`, ...) has its portable op's signature and runs
on CUDA tensors, or on CPU tensors through Triton's interpreter. A planner takes the same
arguments as fake tensors (graph metadata) and returns the `KernelLaunch`es the launcher will
run: that is what ahead-of-time compilation compiles.

The kernel graph calls each launcher through an op of the `portable_cuda` namespace
(`torch.ops.portable_cuda.scale_mask_softmax`, ...), so `torch.compile` sees one opaque call per
kernel (no graph break) and Inductor schedules everything around it. Triton is imported on
first launch, never at import.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from .kernels.launch import KernelLaunch
from .mx_gemm import scaled_mm_mx
from .targets import arch_of_device

__all__ = ["KERNEL_OPS", "TRITON_OPS", "KernelOp", "mx_matmul", "planned_launches"]


def _kernels(name: str) -> ModuleType:
    return importlib.import_module(f"portable.backends.cuda.kernels.{name}")


# -- launchers (the portable ops' signatures) --------------------------------------------------


def mx_quantize(x, format, axis, scale_rule="floor", block_size=32):  # noqa: A002 (op schema)
    return _kernels("mx").quantize(x, format, axis, scale_rule, block_size)


def mx_dequantize(codes, scales, format, axis, dtype, block_size=32):  # noqa: A002
    return _kernels("mx").dequantize(codes, scales, format, axis, dtype, block_size)


def scale_mask_softmax(x, mask=None, scale=1.0, dim=-1):
    return _kernels("softmax").scale_mask_softmax(x, mask, scale, dim)


def attention(q, k, v, mask=None, is_causal=False, scale=None):
    return _kernels("attention").attention(q, k, v, mask, is_causal, scale)


def mx_matmul(a_codes, a_scales, b_codes, b_scales, format, dtype, bias=None):  # noqa: A002
    """`dequantize(a) @ dequantize(b)^T (+ bias)` for a [M, K] and b [N, K], both quantized
    along K. On a device whose arch has native MX (`targets.py`: sm_100) this is one block-scaled
    `torch._scaled_mm`; elsewhere (and on CPU) the operands are dequantized by the Triton kernel
    and multiplied in `dtype`, exactly as the unfused graph does."""
    arch = arch_of_device(a_codes.device)
    if arch is not None and arch.native_mx:
        return scaled_mm_mx(a_codes, a_scales, b_codes, b_scales, format, dtype, bias)
    a = mx_dequantize(a_codes, a_scales, format, 1, dtype)
    b = mx_dequantize(b_codes, b_scales, format, 1, dtype)
    return a @ b.t() if bias is None else torch.addmm(bias, a, b.t())


# -- planners (same arguments, as fake tensors) ------------------------------------------------


def _plan_mx_quantize(x, format, axis, scale_rule="floor", block_size=32):  # noqa: A002
    return _kernels("mx").plan_quantize(
        list(x.shape), x.dtype, format, axis, scale_rule, block_size
    )


def _plan_mx_dequantize(codes, scales, format, axis, dtype, block_size=32):  # noqa: A002
    return _kernels("mx").plan_dequantize(list(codes.shape), format, axis, dtype, block_size)


def _plan_scale_mask_softmax(x, mask=None, scale=1.0, dim=-1):
    return _kernels("softmax").plan_scale_mask_softmax(x, mask, scale, dim)


def _plan_attention(q, k, v, mask=None, is_causal=False, scale=None):
    return _kernels("attention").plan_attention(q, k, v, mask, is_causal, scale)


def _plan_mx_matmul(a_codes, a_scales, b_codes, b_scales, format, dtype, bias=None):  # noqa: A002
    # what runs where the native GEMM cannot (the emulation's two dequantizes)
    return _plan_mx_dequantize(a_codes, a_scales, format, 1, dtype) + _plan_mx_dequantize(
        b_codes, b_scales, format, 1, dtype
    )


# -- the portable_cuda ops of the kernel graph -------------------------------------------------

_LIB = torch.library.Library("portable_cuda", "DEF")


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """A kernel-graph op: its name (the Triton kernel family), launcher and planner."""

    kernel: str
    launcher: Callable[..., Any]
    planner: Callable[..., list[KernelLaunch]]
    fake: Callable[..., Any]

    @property
    def op(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.portable_cuda, self.kernel).default


def _define(
    kernel: str,
    schema: str,
    launcher: Callable[..., Any],
    planner: Callable[..., list[KernelLaunch]],
    fake: Callable[..., Any],
) -> KernelOp:
    _LIB.define(f"{kernel}{schema}")
    _LIB.impl(kernel, launcher, "CompositeExplicitAutograd")
    torch.library.register_fake(f"portable_cuda::{kernel}", fake, lib=_LIB)
    return KernelOp(kernel, launcher, planner, fake)


def _same_as(portable_op: str) -> Callable[..., Any]:
    """A fake kernel that is the portable op's own (same shapes and dtypes)."""
    return lambda *args: getattr(torch.ops.portable, portable_op)(*args)


def _fake_mx_matmul(a_codes, a_scales, b_codes, b_scales, format, dtype, bias=None):  # noqa: A002
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=dtype)


KERNEL_OPS: dict[str, KernelOp] = {
    k.kernel: k
    for k in (
        _define(
            "mx_quantize",
            "(Tensor x, str format, int axis, str scale_rule, int block_size) -> (Tensor, Tensor)",
            mx_quantize,
            _plan_mx_quantize,
            _same_as("mx_quantize"),
        ),
        _define(
            "mx_dequantize",
            "(Tensor codes, Tensor scales, str format, int axis, ScalarType dtype, "
            "int block_size) -> Tensor",
            mx_dequantize,
            _plan_mx_dequantize,
            _same_as("mx_dequantize"),
        ),
        _define(
            "scale_mask_softmax",
            "(Tensor x, Tensor? mask, float scale, int dim) -> Tensor",
            scale_mask_softmax,
            _plan_scale_mask_softmax,
            _same_as("scale_mask_softmax"),
        ),
        _define(
            "attention",
            "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool is_causal, float? scale) -> Tensor",
            attention,
            _plan_attention,
            _same_as("attention"),
        ),
        _define(
            "mx_matmul",
            "(Tensor a_codes, Tensor a_scales, Tensor b_codes, Tensor b_scales, str format, "
            "ScalarType dtype, Tensor? bias) -> Tensor",
            mx_matmul,
            _plan_mx_matmul,
            _fake_mx_matmul,
        ),
    )
}

# portable op (opset name) -> the kernel op that replaces it in the kernel graph
TRITON_OPS: dict[str, KernelOp] = {
    f"portable.{name}.default": KERNEL_OPS[name]
    for name in ("mx_quantize", "mx_dequantize", "scale_mask_softmax", "attention")
}
_BY_OP = {k.op: k for k in KERNEL_OPS.values()}


def planned_launches(gm: torch.fx.GraphModule) -> list[KernelLaunch]:
    """Every KernelLaunch a kernel graph makes, planned from its nodes' fake values."""
    plans: list[KernelLaunch] = []
    for node in gm.graph.nodes:
        kernel = _BY_OP.get(node.target) if node.op == "call_function" else None
        if kernel is None:
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
        plans.extend(kernel.planner(*args, **kwargs))
    return plans
