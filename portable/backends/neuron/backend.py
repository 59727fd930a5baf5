"""`neuron`: programs lowered for AWS Trainium (trn3 by default, trn2, trn1), written offline.

lower -> fp64 downcast (optional) -> JAX rules (platform "neuron") -> tuple-rooted HloModuleProto
      -> read back and parsed -> memory estimate -> offline validator (errors raise) -> io spec,
      neuronx-cc argv
A per-rank program (`Program.is_per_rank`, mesh.size > 1) gives ONE HLO that every rank runs: its
collectives list replica groups of global ranks in NxD order, and a program that needs the rank's
coordinate on an axis (local_shard) takes the NxD rank as a last int32 parameter, `rank_id`
(collectives.py).
A training step whose plan has a pipeline gives one HLO per stage program plus collective-permute
transfer HLOs between stages, and a `pipeline` section in the manifest (pipeline.py).
write(lowered, out_dir) -> the layout of layout.py and manifest.json
compile(written, neuronx-cc, jobs) -> a NEFF and log per program, where neuronx-cc is installed
      (compile.py; `lower --compile`)
check(folder, archive) -> the offline validator again on a written folder (check.py)
executable(written) -> where JAX has neuron devices (the Neuron PJRT plugin on a Trn host, or
      XLA:CPU with PORTABLE_NEURON_STAND_IN=cpu; devices.py), the same JAX lowering run on them
      (run.py); elsewhere BackendError: the artifacts are compiled and run on a Trn host
      (`scripts/compile.sh`, docs/backends/neuron.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from portable.errors import BackendError
from portable.ir.program import Program, ProgramKind
from portable.ir.source import source_of
from portable.runtime import Executable

from ..base import (
    REPORT_TEXT,
    Backend,
    Capabilities,
    CheckedProgram,
    CompileReport,
    CompilerMissingError,
    Lowered,
    Target,
    Toolchain,
    Written,
)
from .artifact import NeuronLowered, NeuronProgram, program_key
from .check import check_folder
from .collectives import ReplicaGroupCollectives, rank_axes, rank_layout
from .command import neuronx_cc_argv
from .compile import COMPILER, compile_all, default_jobs, find_programs, neuronx_cc_available
from .devices import NEURON_STAND_IN, neuron_devices, neuron_here
from .emit import lower_to_hlo
from .findings import Finding, Severity, merge
from .fp64 import downcast_fp64
from .hlo import parse_hlo_text, proto_to_text
from .iospec import io_spec
from .layout import write_layout
from .manifest import build_manifest
from .options import NeuronOptions
from .run import neuron_executable, spmd_of
from .targets import DEFAULT_VARIANT, TARGETS, resolve_target
from .validate import check_findings, validate, validate_lowered

__all__ = ["NeuronBackend", "neuron_spmd_function"]

_NOT_HERE = "neuron programs run on Trainium (NeuronCores); this machine has none"


class NeuronBackend(Backend):
    name = "neuron"
    platform = "neuron"
    options_type = NeuronOptions

    def __init__(self, options: NeuronOptions | None = None) -> None:
        self.options: NeuronOptions = options or NeuronOptions()

    def capabilities(self) -> Capabilities:
        from ..xla.rules.names import names  # the rule table's op names, without importing JAX

        return Capabilities(
            ops=names(self.platform),
            program_kinds=frozenset(ProgramKind),
            variants=tuple(TARGETS),
            default_variant=DEFAULT_VARIANT,
            per_rank=True,  # one HLO for every rank, replica groups in NxD order
            # the lowering rules are JAX's (the same table as xla, platform "neuron")
            requires=("jax", "jaxlib"),
            extra="xla",
            listed_without_requires=False,
            toolchain="neuronx-cc",
            checks=True,
        )

    def can_execute_here(self) -> tuple[bool, str]:
        """True where JAX has neuron devices (devices.neuron_here: the plugin is looked for
        before JAX is imported)."""
        missing = self.unavailable()
        if missing:
            return False, missing
        ok, why = neuron_here()
        return ok, "" if ok else f"{_NOT_HERE}: {why}"

    def lower(self, program: Program, target: Target) -> Lowered:
        if program.plan.pipeline is not None:
            # a pipelined training step: its stages, per-cut transfers and rank map (pipeline.py)
            from .pipeline import lower_pipeline

            return lower_pipeline(program, target, self.options, backend=self).lowered
        self.check_program(program, target)
        ntarget = resolve_target(target.variant, self.options.topology)
        lowered_program, notes = program, []
        if self.options.fp64 == "downcast":
            lowered_program, changed = downcast_fp64(program)
            notes = _fp64_findings(lowered_program, changed)
        records = []
        layout = rank_layout(program, ntarget)
        if layout is not None:
            # one HLO for every rank: replica groups of NxD ranks, the rank as an int32 input
            # when a collective needs its coordinate
            records.append(
                self._lower_one(
                    program,
                    lowered_program,
                    ntarget,
                    notes,
                    ReplicaGroupCollectives(layout),
                    rank_axes(lowered_program.graph),
                )
            )
        else:
            records.append(self._lower_one(program, lowered_program, ntarget, notes))
        first = records[0]
        texts = {"graph.hlo.txt": first.hlo_text, "graph.stablehlo.mlir": first.stablehlo}
        gemms = [g.line() for record in records for g in record.mx_gemms]
        if gemms:  # the lowering report: one line per MX GEMM (native or emulated, why, where)
            texts[REPORT_TEXT] = "\n".join(gemms) + "\n"
        payload = NeuronLowered(ntarget, self.options, tuple(records), layout)
        return Lowered(program, Target("neuron", ntarget.name), texts=texts, payload=payload)

    def lower_with_layout(self, program: Program, target: Target, layout: Any) -> NeuronProgram:
        """One HLO of `program` (a per-rank program, e.g. a pipeline stage's) whose collectives
        list the replica groups of `layout` (collectives.RankLayout of the FULL mesh, which may
        have axes the program does not use, such as pp), validated against that layout: the
        groups must partition the world's ranks (errors raise)."""
        self.check_program(program, target)
        ntarget = resolve_target(target.variant, self.options.topology)
        lowered_program, notes = program, []
        if self.options.fp64 == "downcast":
            lowered_program, changed = downcast_fp64(program)
            notes = _fp64_findings(lowered_program, changed)
        axes = rank_axes(lowered_program.graph)
        record = self._lower_one(
            program, lowered_program, ntarget, notes, ReplicaGroupCollectives(layout), axes
        )
        names = [s.name for s in record.program.signature.inputs]
        kept = [names.index(i["name"]) for i in record.io_spec["inputs"] if i["role"] != "rank"]
        found = validate(
            record.module,
            ntarget,
            self.options,
            program=record.program,
            kept=kept,
            ranks=layout,
            rank_parameter=record.rank_parameter,
        )
        check_findings(found, program=program.name, target=f"neuron:{ntarget.name}")
        return record

    def _lower_one(
        self,
        program,
        lowered_program,
        ntarget,
        notes,
        collectives=None,
        axes=(),
    ):
        """One HLO program: lowered, read back, estimated, validated (errors raise)."""
        from .mx_native import gemm_rules, lower_mx_gemms  # imports JAX

        lowered_program, mx_gemms = lower_mx_gemms(lowered_program, ntarget, self.options)
        impl = "stand-in" if self.options.mx == "stand-in" else "custom-call"
        hlo = lower_to_hlo(
            lowered_program, self.platform, collectives, bool(axes), gemm_rules(impl)
        )
        text = proto_to_text(hlo.proto)  # read back from the bytes that are written
        module = parse_hlo_text(text)
        kept = hlo.kept
        checked, memory = validate_lowered(
            module,
            ntarget,
            self.options,
            lowered_program,
            kept=kept,
            rank_parameter=hlo.rank_parameter,
        )
        layout = collectives.layout if collectives is not None else None
        findings = merge(notes + checked)
        check_findings(findings, program=program.name, target=f"neuron:{ntarget.name}")
        return NeuronProgram(
            key=program_key(program),
            program=lowered_program,
            hlo=hlo.proto,
            hlo_text=text,
            stablehlo=hlo.stablehlo,
            module=module,
            argv=tuple(neuronx_cc_argv(ntarget, self.options, program.kind)),
            io_spec=io_spec(lowered_program, module, kept, hlo.rank_parameter),
            memory=memory,
            findings=tuple(findings),
            ranks=tuple(range(layout.world_size)) if layout is not None else None,
            rank_parameter=hlo.rank_parameter,
            rank_axes=tuple(axes) if hlo.rank_parameter is not None else (),
            collectives=tuple(collectives.emitted) if collectives is not None else (),
            mx_gemms=mx_gemms,
        )

    def write(self, lowered: Lowered, out_dir: Path | None = None) -> Written:
        """Write the artifacts under `out_dir` (compiled by `compile`, or scripts/compile.sh)."""
        files: list[Path] = []
        if out_dir is not None:
            manifest = build_manifest(lowered.payload, lowered.program)
            files = write_layout(Path(out_dir), lowered.payload, manifest)
        return Written(lowered, files, lowered.payload, out_dir)

    def find_toolchain(self) -> Toolchain:
        """neuronx-cc on PATH (CompilerMissingError saying where to get it)."""
        ok, version = neuronx_cc_available()
        if not ok:
            raise CompilerMissingError(
                f"--compile needs the Neuron compiler: {version}",
                fix=f"install {COMPILER} from AWS's Neuron pip repository (the PyPI package of "
                "that name is a placeholder) and put it on PATH; or drop --compile: the output "
                "holds everything needed, and DIR/<neuron target>/scripts/compile.sh compiles it "
                "on a host with the compiler",
            )
        return Toolchain(COMPILER, version)

    def compile_written(
        self, written: Written, toolchain: Toolchain, jobs: int | None
    ) -> CompileReport:
        """neuronx-cc on every program written under `written.out_dir`, `jobs` at once (None:
        one per program, at most one per CPU); a failed program does not stop the others."""
        if written.out_dir is None:
            return CompileReport(toolchain, 0)
        folder = Path(written.out_dir)
        workers = jobs or default_jobs(len(find_programs(folder)))
        results = compile_all(folder, jobs=workers)
        base = folder.parent.resolve()
        return CompileReport(toolchain, workers, tuple(r.to_json(base) for r in results))

    def check(self, folder: Path, archive: Program | None = None) -> list[CheckedProgram]:
        """The offline validator and file checks on every program under `folder/programs/`
        (check.py)."""
        return check_folder(Path(folder), archive)

    def executable(self, compiled: Written) -> Executable:
        """The lowering run through JAX on the neuron devices here (run.py); BackendError
        naming the backends that run here when there are none."""
        from .. import get_backend, registry
        from .pipeline import PipelineLowered

        if isinstance(compiled.payload, PipelineLowered):
            raise BackendError(
                "a pipelined step lowers to one HLO per stage program and transfer; the neuron "
                "backend does not run them as one executable",
                fix="write them with portable.lower(step, 'neuron:<target>', DIR) and run them "
                "on a Trn host in the manifest's pipeline.runtime_order, or here on XLA:CPU with "
                "portable.backends.neuron.pipeline.run_pipeline_stand_in",
            )

        try:
            devices = neuron_devices()
        except BackendError as exc:
            runnable = [
                n
                for n in registry.names()
                if n != self.name and get_backend(n).can_execute_here()[0]
            ]
            target = compiled.lowered.target.variant or DEFAULT_VARIANT
            raise BackendError(
                "neuron programs run on Trainium; lowered artifacts are written, use "
                f"`portable lower --target neuron:{target}`; backends that run here: "
                + ", ".join(runnable),
                fix="compile and run the written artifacts on a Trn host (scripts/compile.sh; "
                "docs/backends/neuron.md), or run there with jax-neuronx installed, where "
                f"portable.compile(program, 'neuron') runs on the NeuronCores; {NEURON_STAND_IN}"
                "=cpu runs the same lowering on XLA:CPU here",
            ) from exc
        return neuron_executable(compiled.lowered.program, compiled.payload, devices, self.name)


def _fp64_findings(program: Program, changed: list[str]) -> list[Finding]:
    """One warning per user source line (or module) whose nodes computed in float64."""
    nodes = {n.name: n for n in program.graph.nodes}
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name in changed:
        src = source_of(nodes[name])
        groups[(src.module, src.location()) if src else (None, None)].append(name)
    return [
        Finding(
            Severity.WARNING,
            "fp64-downcast",
            "float64 computed as float32 (no NeuronCore computes in float64)",
            "compute in float32 in the model, or lower with NeuronOptions(fp64='error') to "
            "refuse float64",
            node=names[0],
            module=module,
            source=location,
            count=len(names),
        )
        for (module, location), names in groups.items()
    ]


def neuron_spmd_function(
    program: Program,
    variant: str,
    devices: Sequence[Any],
    options: NeuronOptions | None = None,
) -> tuple[Any, NeuronProgram]:
    """Per-rank `program` lowered for `neuron:<variant>` (float64 as float32, MX GEMMs decided,
    validator errors raised: what `portable.compile` does) and traced over its mesh of
    `devices`: (the function on global arrays, the lowered record). The neuron job engine's
    entry point."""
    lowered = NeuronBackend(options).lower(program, Target("neuron", variant)).payload
    record = lowered.programs[0]
    return spmd_of(record, lowered.options, devices), record
