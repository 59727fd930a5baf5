"""Ahead-of-time compilation of a program's Triton kernels for an arch: PTX, cubin, metadata.

Uses Triton's own compiler with an explicit `GPUTarget`, so no GPU is needed: PTX comes from
Triton's LLVM backend and the cubin from the `ptxas` bundled with Triton. One launch
specialization (kernel, signature, constexprs, warps) is compiled once per arch however many
nodes use it. What is written per kernel, under `<arch>/kernels/`:

    <key>.ptx     the PTX (`.target sm_90a` / `sm_100a`)
    <key>.cubin   the ELF for that arch
    <key>.json    kernel, function name, signature, constexprs, grid and grid rule, num_warps,
                  num_stages, shared memory, Triton's hash, sha256 of the ptx and cubin
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from portable.errors import LoweringError

from .kernels.launch import KernelLaunch, interpreted, jit_function, kernel_ref
from .targets import CudaArch

__all__ = ["CompiledKernel", "compile_kernel", "compile_kernels", "toolchain_versions"]


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    launch: KernelLaunch
    arch: CudaArch
    name: str  # the function name in the cubin
    ptx: str
    cubin: bytes
    metadata: dict[str, Any]

    def record(self) -> dict[str, Any]:
        """The JSON metadata written beside the PTX and cubin."""
        p = self.launch
        return {
            "kernel": p.kernel,
            "key": p.key,
            "function": self.name,
            "arch": self.arch.name,
            "ptx_target": self.arch.ptx_target,
            "signature": p.signature,
            "constexprs": {k: _jsonable(v) for k, v in p.constexprs.items()},
            "grid": list(p.grid),
            "grid_rule": p.grid_rule,
            "num_warps": p.num_warps,
            "num_stages": p.num_stages,
            "options": {k: _jsonable(v) for k, v in p.options.items()},
            "shared_memory_bytes": self.metadata.get("shared", 0),
            "triton_hash": self.metadata.get("hash"),
            "ptx_sha256": hashlib.sha256(self.ptx.encode()).hexdigest(),
            "cubin_sha256": hashlib.sha256(self.cubin).hexdigest(),
        }

    def write(self, folder: Path) -> list[Path]:
        folder.mkdir(parents=True, exist_ok=True)
        key = self.launch.key
        ptx, cubin, meta = folder / f"{key}.ptx", folder / f"{key}.cubin", folder / f"{key}.json"
        ptx.write_text(self.ptx)
        cubin.write_bytes(self.cubin)
        meta.write_text(json.dumps(self.record(), indent=2, sort_keys=True) + "\n")
        return [ptx, cubin, meta]


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)


# Triton's switch for source line info in PTX/cubin; an environment variable, so that Triton's
# compile cache tells the two forms apart
NO_LINE_INFO = {"TRITON_DISABLE_LINE_INFO": "1"}


@contextmanager
def without_line_info() -> Iterator[None]:
    """Compile kernels without source line info: it names each kernel's source file by its
    absolute path, so the PTX and cubin would depend on where portable is installed."""
    import triton

    with triton.knobs.compilation.scope():
        os.environ.update(NO_LINE_INFO)
        yield


def compile_kernel(launch: KernelLaunch, arch: CudaArch) -> CompiledKernel:
    """Compile one launch for `arch` (LoweringError naming the kernel if Triton refuses)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(
        fn=jit_function(launch.fn), signature=launch.signature, constexprs=launch.constexprs
    )
    options = {
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
        "enable_fp_fusion": True,
        **launch.options,
    }
    try:
        with without_line_info():
            compiled = triton.compile(
                source, target=GPUTarget("cuda", arch.capability, 32), options=options
            )
    except Exception as exc:  # Triton raises CompilationError, RuntimeError, subprocess errors
        raise LoweringError(
            f"Triton could not compile kernel {launch.kernel} for {arch.name}: {exc}",
            backend="cuda",
            op=launch.kernel,
            fix="report it with the program archive; other archs are unaffected",
        ) from exc
    meta = compiled.metadata._asdict()
    return CompiledKernel(
        launch, arch, meta["name"], compiled.asm["ptx"], compiled.asm["cubin"], meta
    )


def compile_kernels(launches: list[KernelLaunch], arch: CudaArch) -> list[CompiledKernel]:
    """Each distinct launch specialization compiled once, in first-use order.

    In a process whose kernels are interpreted (TRITON_INTERPRET=1 when triton was imported)
    Triton cannot compile, so the kernels are compiled in a subprocess without that variable."""
    unique = list({launch.key: launch for launch in launches}.values())
    if any(interpreted(launch.fn) for launch in unique):
        return _compile_in_subprocess(unique, arch)
    return [compile_kernel(launch, arch) for launch in unique]


def _request(launch: KernelLaunch) -> dict[str, Any]:
    return {
        "ref": kernel_ref(launch.fn),
        "signature": launch.signature,
        "constexprs": launch.constexprs,
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
        "options": launch.options,
    }


def _compile_in_subprocess(launches: list[KernelLaunch], arch: CudaArch) -> list[CompiledKernel]:
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | NO_LINE_INFO
    with tempfile.TemporaryDirectory(prefix="portable-aot-") as tmp:
        request = {
            "capability": arch.capability,
            "out": tmp,
            "launches": [_request(x) for x in launches],
        }
        proc = subprocess.run(
            [sys.executable, "-m", "portable.backends.cuda.aot_worker"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if proc.returncode != 0:
            raise LoweringError(
                f"Triton could not compile the kernels for {arch.name}: "
                + (proc.stderr.strip().splitlines() or ["(no output)"])[-1],
                backend="cuda",
                fix="report it with the program archive; run without TRITON_INTERPRET=1 to see "
                "the compiler's full message",
            )
        results = json.loads(proc.stdout)
        return [
            CompiledKernel(
                launch,
                arch,
                r["name"],
                Path(r["ptx"]).read_text(),
                Path(r["cubin"]).read_bytes(),
                r["metadata"],
            )
            for launch, r in zip(launches, results, strict=True)
        ]


def toolchain_versions() -> dict[str, Any]:
    """torch, Triton, and the CUDA toolchain (ptxas bundled with Triton) that made the kernels."""
    import torch
    import triton
    from triton.backends.nvidia.compiler import get_ptxas_version

    def release(arch: int) -> str:
        text = get_ptxas_version(arch)
        line = next((ln for ln in text.splitlines() if "release" in ln), text.strip())
        return line.split("release", 1)[-1].strip()

    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # None for a CPU build of torch
        "triton": triton.__version__,
        "ptxas": {"sm_90": release(90), "sm_100": release(100)},
    }
