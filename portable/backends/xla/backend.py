"""`xla`: programs executed on XLA:CPU through `jax.jit`, so parity runs everywhere.

lower -> StableHLO and HLO text (inspectable); write -> an XLA executable (and the texts under
out_dir); executable -> the portable Executable. A per-rank program (`Program.is_per_rank`: a
layout over more than one rank) runs on mesh.size XLA devices under shard_map and takes and
returns GLOBAL values (spmd.py). A training step whose plan has a pipeline runs its stages on
mesh.size XLA devices as one SPMD program (pipeline.py): over a mesh with other axes (pp x dp x
tp), the step is first partitioned over them and each device runs its stages' per-rank programs;
it takes and returns GLOBAL values.
Tensors cross between torch and JAX by DLPack (zero-copy on CPU). JAX is imported only when this
backend is used.
"""

from __future__ import annotations

from pathlib import Path

from portable.ir.program import Program, ProgramKind
from portable.runtime import Executable

from ..base import Backend, Capabilities, Lowered, Target, Written
from .compiler import compile_lowered, lowered_texts, row_major

__all__ = ["XlaBackend"]


class XlaBackend(Backend):
    name = "xla"
    platform = "xla"

    def capabilities(self) -> Capabilities:
        from .rules.names import names  # the rule table's op names, without importing JAX

        return Capabilities(
            ops=names(self.platform),
            program_kinds=frozenset(ProgramKind),
            requires=("jax", "jaxlib"),
            extra="xla",
            listed_without_requires=False,  # the op list is the JAX rule table's
            per_rank=True,  # on mesh.size XLA devices under shard_map (spmd.py)
        )

    def lower(self, program: Program, target: Target) -> Lowered:
        self.check_program(program, target)  # first: BackendError when jax is missing
        from .lowering import lower
        from .spmd import spmd_function

        if is_pipelined(program):
            from .pipeline import pipeline_function

            stages = pipeline_function(program)  # one program under shard_map over the mesh
            return Lowered(program, target, texts=lowered_texts(stages.lowered), payload=stages)
        if program.is_per_rank:
            # a per-rank program runs on mesh.size devices under shard_map (spmd.py); the texts
            # are the SPMD module before XLA partitions it
            fn = spmd_function(program)
            return Lowered(program, target, texts=lowered_texts(fn.lowered), payload=fn)
        # executed programs are not donated: their inputs are torch tensors shared via DLPack
        jax_lowered = lower(program, self.platform, donate=False)
        return Lowered(program, target, texts=lowered_texts(jax_lowered), payload=jax_lowered)

    def write(self, lowered: Lowered, out_dir: Path | None = None) -> Written:
        """The texts under `out_dir`, and the XLA executable (compiled here, in memory)."""
        files = []
        if out_dir is not None:
            for name, text in lowered.texts.items():
                path = out_dir / name
                path.write_text(text)
                files.append(path)
        if lowered.program.is_per_rank or is_pipelined(lowered.program):
            return Written(lowered, files, payload=lowered.payload)
        return Written(lowered, files, payload=compile_lowered(lowered.payload))

    def executable(self, compiled: Written) -> Executable:
        import jax
        import jax.numpy as jnp
        import torch

        from .spmd import SpmdExecutable

        if is_pipelined(compiled.lowered.program):
            from .pipeline import PipelineExecutable

            return PipelineExecutable(compiled.lowered.program, self.name, compiled.payload)
        if compiled.lowered.program.is_per_rank:
            # GLOBAL inputs and outputs (spmd.py's module docstring)
            return SpmdExecutable(compiled.lowered.program, self.name, compiled.payload)
        xla_executable = compiled.payload

        def run(flat):
            with jax.enable_x64(True):
                outs = xla_executable(*[jnp.from_dlpack(row_major(t)) for t in flat])
            return [torch.from_dlpack(o) for o in outs]

        return Executable(compiled.lowered.program, run, self.name)


def is_pipelined(program: Program) -> bool:
    """A step this backend runs as pipeline stages (pipeline.py): a plan with a pipeline, and
    not per-rank (JAX is not imported to tell)."""
    return program.plan.pipeline is not None and not program.is_per_rank
