"""`cpu`: the reference backend. Executes the program's graph with eager PyTorch.

Every other backend is compared against it. Lowering is the identity on the graph; `write` (the
protocol's default) writes the program's stable text form. Every opset op with a CPU kernel is
supported.
"""

from __future__ import annotations

import torch

from portable.ir.program import Program, ProgramKind
from portable.opset import opset_table
from portable.opset.layouts import in_fake_layout
from portable.runtime import Executable
from portable.torch_compat import copy_graph_module

from .base import Backend, Capabilities, Lowered, Target, Written


class CpuBackend(Backend):
    name = "cpu"

    def capabilities(self) -> Capabilities:
        ops = frozenset(opset_table())
        # per-rank programs: one rank each under `portable run --nproc` (distributed/worker.py)
        return Capabilities(ops=ops, program_kinds=frozenset(ProgramKind), per_rank=True)

    def lower(self, program: Program, target: Target) -> Lowered:
        self.check_program(program, target)
        return Lowered(program, target, texts={"graph.txt": program.text()})

    def executable(self, compiled: Written) -> Executable:
        program = compiled.lowered.program
        gm = copy_graph_module(program.graph_module)
        in_fake_layout(gm)  # results in the layouts the graph was traced with

        def run(flat):
            with torch.no_grad():
                return gm(*flat)

        return Executable(program, run, self.name)
