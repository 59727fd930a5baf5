"""What `write(lowered, out_dir)` writes for the cuda backend, and its manifest.

<out>/program.pt2              torch.export archive of the export graph (pt2.py); no pickle
<out>/graph.py                 the export graph's code (arch-neutral)
<out>/<arch>/graph.py          the kernel graph for that arch (what runs on the GPU)
<out>/<arch>/kernels/<key>.*   each Triton kernel: .ptx, .cubin, .json (aot.py)
<out>/<arch>/aoti.pt2          AOTInductor package (only with `--aot` on a CUDA machine)
<out>/manifest.json            versions, archs, kernels with hashes, and per arch what runs
                               natively and what is emulated
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from portable.errors import BackendError
from portable.file_digest import sha256_file
from portable.ir.program import Program, ProgramKind

from ..base import Lowered
from . import aot
from .options import CudaOptions
from .pt2 import buffer_name, export_program, save_pt2
from .targets import CudaArch, arch_of_capability

if TYPE_CHECKING:  # backend.py imports this module
    from .backend import CudaLowered

__all__ = ["FORMAT", "FORMAT_VERSION", "write_layout"]

FORMAT = "portable.cuda"
FORMAT_VERSION = 1

_CALLS = {
    ProgramKind.INFERENCE: "module(*inputs) -> outputs",
    ProgramKind.TRAINING_STEP: "module(*batch) -> loss; updates its buffers (weights, optimizer "
    "state) in place",
}


def write_layout(out: Path, lowered: Lowered, options: CudaOptions) -> list[Path]:
    """Write the layout into `out`: built in a temporary sibling folder and moved in at the end,
    so a failure (export, a kernel Triton refuses) leaves `out` as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        files = _write(tmp, lowered, options)
        out.mkdir(exist_ok=True)
        for entry in sorted(tmp.iterdir()):
            target = out / entry.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(entry, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / p.relative_to(tmp) for p in files]


def _write(out: Path, lowered: Lowered, options: CudaOptions) -> list[Path]:
    payload: CudaLowered = lowered.payload
    program = lowered.program
    files: list[Path] = []
    for name, text in lowered.texts.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        files.append(path)

    pt2 = save_pt2(export_program(program, payload.export_gm), out / "program.pt2")
    files.append(pt2)

    archs: dict[str, Any] = {}
    for arch in payload.archs:
        kernels = aot.compile_kernels(payload.launches[arch.name], arch)
        records = []
        for kernel in kernels:
            written = kernel.write(out / arch.name / "kernels")
            files += written
            record = kernel.record()
            records.append(
                {
                    "kernel": record["kernel"],
                    "key": record["key"],
                    "function": record["function"],
                    "files": [str(p.relative_to(out)) for p in written],
                    "ptx_sha256": record["ptx_sha256"],
                    "cubin_sha256": record["cubin_sha256"],
                    "shared_memory_bytes": record["shared_memory_bytes"],
                    "num_warps": record["num_warps"],
                }
            )
        archs[arch.name] = {
            "family": arch.family,
            "gpus": arch.gpus,
            "ptx_target": arch.ptx_target,
            "graph": f"{arch.name}/graph.py",
            "kernels": records,
            **_native_and_emulated(payload, arch),
        }

    aoti = None
    if options.aot:
        aoti = _write_aot_inductor(out, program, payload)
        files += [out / a["file"] for a in aoti.values()]

    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "program": program.identity(),
        "toolchain": aot.toolchain_versions(),
        "pt2": {
            "file": "program.pt2",
            "sha256": sha256_file(pt2),
            "call": _CALLS[program.kind],
            "load": "portable.backends.cuda.load_pt2(path).module()",
            "buffers": {buffer_name(s.key): s.key for s in program.signature.state_inputs},
        },
        "ops": dict(Counter(d.impl for d in payload.decisions)),
        "decisions": [d.to_json() for d in payload.decisions],
        "archs": archs,
        "aot_inductor": aoti,
    }
    path = out / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return [*files, path]


def _native_and_emulated(payload: CudaLowered, arch: CudaArch) -> dict[str, Any]:
    """Per arch: which of the program's numerics run on native hardware paths and which are
    emulated (MX matmuls without native block-scaled GEMM run as dequantize -> matmul), and
    which Triton kernels run."""
    decisions = payload.decisions + payload.arch_decisions[arch.name]
    mx = [d for d in decisions if d.op == "mx_matmul"]
    triton = sorted({d.impl.split(":", 1)[1] for d in decisions if d.impl.startswith("triton:")})
    return {
        "native_mx_matmul": arch.native_mx,
        "native": [d.to_json() for d in mx if d.impl == "native-mx"],
        "emulated": [d.to_json() for d in mx if d.impl == "emulated-mx"],
        "triton_kernels": triton,
        "decisions": [
            d.to_json() for d in payload.arch_decisions[arch.name] if d.op != "mx_matmul"
        ],
    }


def _write_aot_inductor(out: Path, program: Program, payload: CudaLowered) -> dict[str, Any]:
    """AOTInductor package of the export graph for the arch of the CUDA device present."""
    if not torch.cuda.is_available():
        raise BackendError(
            "--aot writes an AOTInductor package, which compiles for the CUDA device present; "
            "this machine has none",
            fix="drop --aot here (kernels, PTX/cubin and the .pt2 are still written), or run "
            "`portable lower --aot` on a GPU machine",
        )
    capability = torch.cuda.get_device_capability()
    arch = arch_of_capability(*capability)
    if arch is None:
        raise BackendError(
            f"--aot compiles for the CUDA device present, of compute capability "
            f"{capability[0]}.{capability[1]}; cuda targets sm_90 and sm_100",
            fix="run `portable lower --aot` on an sm_90 or sm_100 GPU, or drop --aot",
        )
    from torch.export.passes import move_to_device_pass

    from . import ops  # noqa: F401 (CUDA kernels of the portable ops)

    ep = move_to_device_pass(export_program(program, payload.export_gm), "cuda")
    path = out / arch.name / "aoti.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return {arch.name: {"file": str(path.relative_to(out)), "sha256": sha256_file(path)}}
