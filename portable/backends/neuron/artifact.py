"""The neuron backend's lowered form: per program, the HLO and everything derived from it."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shlex
from typing import Any

from portable.ir.program import Program

from .findings import Finding
from .hlo import HloModule
from .memory import MemoryEstimate
from .options import NeuronOptions
from .script import cache_key
from .targets import NeuronTarget

__all__ = ["NeuronLowered", "NeuronProgram", "program_key"]


def program_key(program: Program) -> str:
    """The folder name of a program under `programs/` (its name, path-safe)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", program.name) or "program"


@dataclasses.dataclass(frozen=True)
class NeuronProgram:
    key: str
    program: Program  # as lowered (after the fp64 downcast)
    hlo: bytes  # serialized HloModuleProto: graph.hlo
    hlo_text: str  # XLA's text of `hlo`, with metadata: graph.hlo.txt
    stablehlo: str  # graph.stablehlo.mlir
    module: HloModule  # `hlo_text` parsed
    argv: tuple[str, ...]  # neuronx-cc argv: command.txt
    io_spec: dict[str, Any]
    memory: MemoryEstimate
    findings: tuple[Finding, ...]  # warnings only (errors raise during lowering)
    # per-rank programs: the NxD ranks that run this HLO (all of them), the parameter number of
    # the int32 rank input and the axes whose coordinate is computed from it (local_shard), and
    # every collective's replica groups in program order
    ranks: tuple[int, ...] | None = None
    rank_parameter: int | None = None
    rank_axes: tuple[str, ...] = ()
    collectives: tuple[dict[str, Any], ...] = ()
    mx_gemms: tuple[Any, ...] = ()  # mx_native.MXGemm per MX GEMM: native or emulated, why

    @property
    def command_txt(self) -> str:
        return shlex.join(self.argv) + "\n"

    @property
    def hlo_sha256(self) -> str:
        return hashlib.sha256(self.hlo).hexdigest()

    @property
    def cache_key(self) -> str:
        return cache_key(self.hlo, self.command_txt)


@dataclasses.dataclass(frozen=True)
class NeuronLowered:
    target: NeuronTarget
    options: NeuronOptions
    programs: tuple[NeuronProgram, ...]
    ranks: Any = None  # collectives.RankLayout of a per-rank lowering, else None
