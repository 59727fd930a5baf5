"""One concrete Triton launch: what ahead-of-time compilation compiles and what runs.

Every kernel module plans its launches with a `plan_*` function of shapes, dtypes and op
parameters, and its launcher runs exactly that plan, so the PTX/cubin written ahead of time are
the kernels the program calls. `run` launches a plan on CUDA tensors, or through Triton's
interpreter on CPU tensors (and whenever `TRITON_INTERPRET=1`): that is how the kernels are
tested without a GPU (with TRITON_INTERPRET=1 set before triton is imported).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from portable.errors import BackendError

__all__ = [
    "KernelLaunch",
    "TRITON_TYPES",
    "interpreted",
    "kernel_ref",
    "jit_function",
    "run",
    "triton_type",
]

# torch dtype -> the Triton type of a pointer to it (signature strings: "*fp32", "i32", ...)
TRITON_TYPES: dict[torch.dtype, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}


def triton_type(dtype: torch.dtype, pointer: bool = True) -> str:
    base = TRITON_TYPES[dtype]
    return "*" + base if pointer else base


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """A Triton kernel with the concrete signature and constexprs one program needs.

    `signature` maps every parameter of the kernel, in order, to its Triton type ("*fp32",
    "i32", "fp32", or "constexpr"); `constexprs` gives the value of each constexpr parameter.
    `grid` is the concrete launch grid for these shapes and `grid_rule` says how it follows from
    them (written into the kernel metadata). `options` go to the Triton compiler as they are
    (kernels that must be bit-exact pass `enable_fp_fusion=False`)."""

    kernel: str  # stable name, e.g. "mx_quantize"
    fn: Any  # the @triton.jit function (a JITFunction, or an InterpretedFunction)
    signature: dict[str, str]
    constexprs: dict[str, Any]
    grid: tuple[int, ...]
    grid_rule: str
    num_warps: int = 4
    num_stages: int = 2
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        """A name unique to this specialization (kernel, signature, constexprs, warps)."""
        import hashlib
        import json

        blob = json.dumps(
            [
                self.signature,
                {k: repr(v) for k, v in self.constexprs.items()},
                self.num_warps,
                self.num_stages,
                sorted(self.options.items()),
            ],
            sort_keys=True,
        )
        return f"{self.kernel}_{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def interpreted(fn: Any) -> bool:
    """Whether `fn` was made by `triton.jit` in interpreter mode (TRITON_INTERPRET=1 at import)."""
    return type(fn).__name__ == "InterpretedFunction"


def jit_function(fn: Any) -> Any:
    """The compilable JITFunction behind `fn`. With TRITON_INTERPRET=1, `triton.jit` returns an
    InterpretedFunction, and the functions it calls (its helpers, `tl.max`, ...) are interpreted
    too, so that process cannot compile it: `aot.py` then compiles in a clean subprocess."""
    from triton.runtime.jit import JITFunction

    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)


def kernel_ref(fn: Any) -> str:
    """`module:function` naming a kernel, so another process can import it."""
    raw = fn.fn if hasattr(fn, "fn") else fn
    return f"{raw.__module__}:{raw.__name__}"


def run(plan: KernelLaunch, *args: Any) -> None:
    """Launch `plan` with the runtime arguments `args` (its non-constexpr parameters, in order).

    CUDA tensors run the compiled kernel. CPU tensors run it in Triton's interpreter, which
    Triton enables only when TRITON_INTERPRET=1 was set before triton was imported (its
    `triton.language` functions are built for one mode or the other at import)."""
    on_cpu = any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in args)
    kwargs: dict[str, Any] = dict(plan.constexprs)
    if on_cpu and not interpreted(plan.fn):
        raise BackendError(
            f"Triton kernel {plan.kernel} got CPU tensors; Triton runs kernels on CPU only in "
            "its interpreter",
            fix="set TRITON_INTERPRET=1 in the environment before Python starts (before triton "
            "is imported), or pass CUDA tensors",
        )
    if not interpreted(plan.fn):
        kwargs.update(num_warps=plan.num_warps, num_stages=plan.num_stages)
        kwargs.setdefault("enable_fp_fusion", True)
        kwargs.update(plan.options)
    plan.fn[plan.grid](*args, **kwargs)
