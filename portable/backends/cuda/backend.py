"""`cuda`: programs lowered to PyTorch + Triton for Hopper (sm_90) and Blackwell (sm_100).

lower    -> export graph (ATen + kernel-backed portable ops) and one kernel graph per arch
            (lowering.py), every Triton launch planned from the graph's fake values
compile  -> with an out_dir: each kernel compiled ahead of time per arch (aot.py), the `.pt2`
            (pt2.py), graph code, manifest (layout.py); with `--aot` on a CUDA machine also an
            AOTInductor package
executable -> the kernel graph of the device's arch under `torch.compile`, state on the device;
            BackendError naming the backends that run here when there is no CUDA device
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from portable.errors import BackendError
from portable.ir.program import Program, ProgramKind
from portable.opset import opset_table
from portable.opset.layouts import in_fake_layout
from portable.runtime import Executable
from portable.torch_compat import copy_graph_module

from .. import get_backend, registry
from ..base import INTEGER_DTYPES, Backend, Capabilities, Lowered, Target, Written
from .decisions import Decision
from .dispatch import planned_launches
from .kernels.launch import KernelLaunch
from .layout import write_layout
from .lowering import export_graph, kernel_graph, mx_mode, retarget_devices
from .options import CudaOptions
from .targets import ARCHS, CudaArch, arch_of_capability, arch_of_device, parse_archs

__all__ = ["CudaBackend", "CudaLowered"]


@dataclasses.dataclass
class CudaLowered:
    archs: tuple[CudaArch, ...]
    export_gm: torch.fx.GraphModule
    decisions: list[Decision]  # export-graph decisions (sdpa / triton), shared by every arch
    kernel_gms: dict[str, torch.fx.GraphModule]  # arch name -> kernel graph
    arch_decisions: dict[str, list[Decision]]  # arch name -> MX matmul decisions
    launches: dict[str, list[KernelLaunch]]  # arch name -> KernelLaunches, in graph order


# PyTorch's CUDA convolution (cuDNN and its fallbacks) and pooling kernels take floats only
_FLOAT_ONLY_ON_CUDA = (
    "aten.convolution.default",
    "aten.avg_pool2d.default",
    "aten.avg_pool3d.default",
    "aten.max_pool2d_with_indices.default",
)
_NO_INTEGER_KERNEL = {
    name: "PyTorch's CUDA kernel for it takes floating-point types only" for name in INTEGER_DTYPES
}


class CudaBackend(Backend):
    name = "cuda"
    options_type = CudaOptions

    def __init__(self, options: CudaOptions | None = None) -> None:
        self.options: CudaOptions = options or CudaOptions()

    def capabilities(self) -> Capabilities:
        # Every opset op: ATen ops run as PyTorch ops, portable ops as ATen rewrites, device-
        # generic kernels or Triton kernels. The variant is one arch or a comma list of them.
        return Capabilities(
            ops=frozenset(opset_table()),
            program_kinds=frozenset(ProgramKind),
            variants=tuple(ARCHS),
            combines_variants=True,
            requires=("triton",),  # kernels are planned and compiled by Triton
            # a per-rank program's collectives and local shapes have no lowering here (its
            # global weights would reach torch.export): refused by check_program
            per_rank=False,
            dtype_gaps={name: _NO_INTEGER_KERNEL for name in _FLOAT_ONLY_ON_CUDA},
        )

    def check_options(self) -> None:
        """`aot` compiles an AOTInductor package for the CUDA device present: refuse it on a
        machine without one, before any work."""
        if self.options.aot and not torch.cuda.is_available():
            raise BackendError(
                "--aot compiles an AOTInductor package for the CUDA device present; this "
                "machine has none",
                fix="drop --aot here (the kernels' PTX/cubin and the .pt2 are written without "
                "it), or run the same command on a GPU machine",
            )

    def can_execute_here(self) -> tuple[bool, str]:
        missing = self.unavailable()
        if missing:
            return False, missing
        if self.options.device == "cpu":
            if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
                return False, (
                    "device='cpu' runs the Triton kernels in Triton's interpreter: set "
                    "TRITON_INTERPRET=1 before Python starts"
                )
            return True, ""
        if not torch.cuda.is_available():
            return False, "no CUDA device on this machine"
        cap = torch.cuda.get_device_capability()
        if arch_of_capability(*cap) is None:
            return (
                False,
                f"CUDA device of compute capability {cap[0]}.{cap[1]} (sm_90 or sm_100 needed)",
            )
        return True, ""

    def lower(self, program: Program, target: Target) -> Lowered:
        archs = parse_archs(target.variant)  # BackendError naming the archs there are
        self.check_program(program, target)
        export_gm, decisions = export_graph(program)
        kernel_gms, arch_decisions, launches = {}, {}, {}
        for arch in archs:
            gm, mx = kernel_graph(export_gm, arch, mx_mode(program))
            kernel_gms[arch.name], arch_decisions[arch.name] = gm, mx
            launches[arch.name] = planned_launches(gm)
        texts = {"graph.py": export_gm.code}
        texts.update({f"{a}/graph.py": gm.code for a, gm in kernel_gms.items()})
        payload = CudaLowered(archs, export_gm, decisions, kernel_gms, arch_decisions, launches)
        variant = ",".join(a.name for a in archs)
        return Lowered(program, Target(self.name, variant), texts=texts, payload=payload)

    def write(self, lowered: Lowered, out_dir: Path | None = None) -> Written:
        """With `out_dir`: kernels compiled for every arch, the `.pt2`, graphs and manifest (and
        with the `aot` option, the AOTInductor package: cuda's compile happens here)."""
        files: list[Path] = []
        if out_dir is not None:
            lowered.program.require_values("writing cuda's artifacts (the .pt2 holds the weights)")
            files = write_layout(Path(out_dir), lowered, self.options)
        return Written(lowered, files, lowered.payload, out_dir)

    def executable(self, compiled: Written) -> Executable:
        ok, why = self.can_execute_here()
        if not ok:
            here = [
                n
                for n in registry.names()
                if n != self.name and get_backend(n).can_execute_here()[0]
            ]
            raise BackendError(
                f"cuda programs need a CUDA GPU: {why}; backends that run here: {', '.join(here)}",
                fix="run on a machine with an sm_90 or sm_100 GPU, or use `portable lower "
                "--target cuda:sm_90 --target cuda:sm_100` to write the kernels and .pt2 here",
            )
        return _executable(compiled.lowered, self.options)


def _executable(lowered: Lowered, options: CudaOptions) -> Executable:
    payload: CudaLowered = lowered.payload
    device = torch.device(options.device)
    # on CPU every kernel is interpreted: the graph of the first arch
    arch = arch_of_device(device) if device.type == "cuda" else payload.archs[0]
    if arch is None:
        raise BackendError(
            f"{device} is not an sm_90 or sm_100 GPU (the archs cuda lowers for)",
            fix="pass device= a GPU of one of those archs",
        )
    gm = payload.kernel_gms.get(arch.name)
    if gm is None:
        gm = kernel_graph(payload.export_gm, arch, mx_mode(lowered.program))[0]
    else:
        gm = copy_graph_module(gm)
    retarget_devices(gm, device)
    gm = gm.to(device)
    if not options.torch_compile:  # eager ATen kernels: results in the traced layouts
        in_fake_layout(gm)
    fn = torch.compile(gm, dynamic=False) if options.torch_compile else gm

    def run(flat):
        with torch.no_grad():
            return fn(*[t.to(device) for t in flat])

    exe = Executable(lowered.program, run, "cuda")
    exe.state = {k: v.to(device) for k, v in exe.state.items()}
    return exe
