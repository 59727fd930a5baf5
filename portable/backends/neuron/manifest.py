"""`manifest.json` of a neuron lowering: what was produced, for which toolchain and target, what the
runtime needs, the memory estimate, the validator's warnings, and what was verified where.

No timestamps or host paths: two lowerings of the same program give the same manifest.
"""

from __future__ import annotations

import collections
import dataclasses
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from portable.ir.program import Program

from .artifact import NeuronLowered, NeuronProgram
from .collectives import RANK_INPUT
from .command import HLO_FILE, LOG_FILE, NEFF_FILE, neuron_cc_flags
from .hlo import HloModule
from .runtime_env import runtime_env
from .validate import CHECKS, COLLECTIVES
from .validate_mx import MX_CALLS

__all__ = ["FORMAT", "FORMAT_VERSION", "build_manifest", "collectives_summary"]

FORMAT = "portable-neuron"
FORMAT_VERSION = 1
_PACKAGES = ("portable", "torch", "jax", "jaxlib", "numpy")

TOOLCHAIN = {
    "compiler": "neuronx-cc",
    "command": "neuronx-cc compile --framework=XLA",
    "input": "serialized HloModuleProto (model/graph.hlo), tuple root",
    "expected": "Neuron SDK 2.32 or later (neuronx-cc from AWS's Neuron package repository); "
    "flags follow the 2.32/2.33 documentation: verify them against the installed neuronx-cc",
    "int64_flags": "pinned: --implicit-integer-downcast=all on every target, "
    "--native-int64=disabled on trn2 and trn3 (the 2.32 CLI reference: only available on trn2 "
    "and later)",
    "target_flag": "--target=trn3 is what AWS's own code passes (NKI MX examples, NxD's hardware "
    "enum) but is not yet in the 2.32 CLI reference, which lists inf2, trn1, trn1n and trn2",
}

LAYOUT = {
    "nxd_model_builder": "model/graph.hlo, graph.neff and the compiler log sit as NxD "
    "ModelBuilder places them (<workdir>/<tag>/_tp0_bk<N>/model/graph.hlo, the NEFF and log "
    "beside model/)",
    "portable_only": "programs/<key>/ in place of <tag>/_tp0_bk<N>/, command.txt, io_spec.json, "
    "model/graph.hlo.txt, model/graph.stablehlo.mlir, manifest.json and scripts/compile.sh are "
    "portable's own: no Neuron tool reads them",
}

NEEDS_HARDWARE = (
    "that the installed neuronx-cc accepts graph.hlo with command.txt's flags "
    "(exit 0 and 'Compiler status PASS'; NCC_* errors otherwise), --target=trn3 included",
    "the validator's readings of the documentation: allow-lists read from the docs, not the "
    "compiler; sort comparators judged by their root compare (JAX's TOTALORDER ones pass); "
    "arithmetic right shifts of int64 refused; complex64 on the 2.32 release notes' ops only; "
    "FP8 E3M4 refused",
    "compile time and the compiler's host memory",
    "loading and running graph.neff on a NeuronCore with the runtime environment above",
    "numerics on device (BF16/FP8 paths, FP32 accumulation of integer ops, int64 computed as "
    "int32, stochastic rounding) against the cpu reference",
    "device HBM use against the memory estimate",
    "collectives across cores and nodes",
    "performance",
)


MX_LOWERING = {
    "hlo": "integer HLO on the values' bit patterns (bitcast-convert, and/or/xor, add/subtract, "
    "shifts, compare/select, maximum/minimum/clamp, one s32 reduce-max per block); no FP8/FP4 "
    "element types",
    "reason": "MX ops outside a native GEMM lower to that integer HLO, bit-exact with portable.mx "
    "on every generation; on trn3 (NeuronOptions(mx='native')) each MX GEMM whose recipe fits "
    "the custom calls lowers to QuantizeMX per operand + one __op$block_scaled_dot (the "
    "decision per GEMM is under `gemms`; docs/backends/neuron.md, 'MX on Trainium3')",
}
MX_NATIVE = {
    "custom_calls": "QuantizeMX (backend_config dim -1/-2, block_size 32, scale_method EMAX, "
    "dtype float8_e4m3fn/float8_e5m2) -> (u32 data, u8 scales); __op$block_scaled_dot(lhs, "
    "rhs, lhs_scale, rhs_scale) with scaled_dot_backend_config contracting dims",
    "assumed": [
        "four FP8 codes per u32 along the quantized dim, element 4i in the low byte",
        "scales: u8 E8M0 bytes, the input's shape with the quantized dim / 32",
        "EMAX bytes equal portable.mx.quantize(scale_rule='emax'), zero and tiny blocks included",
    ],
    "needs_hardware": [
        "that neuronx-cc accepts this backend_config",
        "the device's bytes for zero and tiny blocks",
        "block_scaled_dot's accumulation order and precision",
        "speed",
    ],
}


def build_manifest(lowered: NeuronLowered, program: Program) -> dict[str, Any]:
    """The manifest of `lowered` (the lowering of `program`); an `mx` field only when the
    program has MX ops."""
    target, options = lowered.target, lowered.options
    first = lowered.programs[0]
    mx = _mx_summary(lowered)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "program": program.identity(),
        "target": {
            "backend": "neuron",
            "variant": target.name,
            "compiler_target": target.compiler_target,
            "logical_nc_config": target.logical_nc_config,
            "hbm_per_core_bytes": target.hbm_per_core_bytes,
            "hbm_basis": target.hbm_basis,
            "fp8_types": sorted(target.fp8_types),
            "mx": target.mx,
            "cores_per_chip": target.cores_per_chip,
            "topology": target.topology.to_json(target.cores_per_chip),
        },
        "toolchain": TOOLCHAIN,
        "dependencies": _dependencies(),
        "options": dataclasses.asdict(options),
        "neuron_cc_flags": neuron_cc_flags(target, options, first.program.kind),
        "runtime_env": runtime_env(target, options, first.program, first.module),
        "compile": {
            "script": "scripts/compile.sh",
            "outputs": [NEFF_FILE, LOG_FILE],
            "success": "exit 0 and 'Compiler status PASS' in the log",
            "cache_key": "sha256(model/graph.hlo bytes + command.txt bytes), per compiler version",
            "layout": LAYOUT,
        },
        "programs": [_program(p, lowered.ranks) for p in lowered.programs],
        "collectives": _merged_collectives(lowered),
        **({"spmd": _spmd(lowered)} if lowered.ranks is not None else {}),
        **({"pipeline": _pipeline(lowered)} if _pipeline(lowered) is not None else {}),
        **({"mx": mx} if mx else {}),
        "validation": {
            "checks": [check.__name__ for check in CHECKS],
            "errors": 0,
            "warnings": sum(len(p.findings) for p in lowered.programs),
        },
        "verification": {
            "verified_offline": _verified_offline(lowered),
            "needs_hardware": list(NEEDS_HARDWARE),
        },
    }


def collectives_summary(module: HloModule) -> dict[str, Any]:
    """Collective instructions by kind (`-start` halves of async pairs counted once)."""
    counts: collections.Counter[str] = collections.Counter()
    for ins in module.instructions():
        kind = ins.opcode.removesuffix("-start")
        if kind in COLLECTIVES and not ins.opcode.endswith("-done"):
            counts[kind] += 1
    return _summary(counts)


def _summary(counts: collections.Counter[str]) -> dict[str, Any]:
    total = sum(counts.values())
    by_kind = dict(sorted(counts.items()))
    text = ", ".join(f"{n} {k}" for k, n in by_kind.items()) or "none: single-device program"
    return {"total": total, "by_kind": by_kind, "summary": text}


def _program(prog: NeuronProgram, layout: Any = None) -> dict[str, Any]:
    base = f"programs/{prog.key}"
    return {
        "key": prog.key,
        "kind": prog.program.kind.value,
        "dir": base,
        "files": {
            "hlo": f"{base}/{HLO_FILE}",
            "hlo_text": f"{base}/model/graph.hlo.txt",
            "stablehlo": f"{base}/model/graph.stablehlo.mlir",
            "command": f"{base}/command.txt",
            "io_spec": f"{base}/io_spec.json",
        },
        "hlo_sha256": prog.hlo_sha256,
        "cache_key": prog.cache_key,
        "argv": list(prog.argv),
        "instructions": prog.module.instruction_count,
        "parameters": len(prog.module.parameters()),
        "aliases": len(prog.module.aliases),
        "collectives": collectives_summary(prog.module),
        "memory": prog.memory.to_json(),
        "io_spec": prog.io_spec,
        "findings": [f.to_json() for f in prog.findings],
        **(
            {
                "ranks": list(prog.ranks),
                "rank_input": _rank_input(prog, layout),
                "replica_groups": [dict(c) for c in prog.collectives],
            }
            if prog.ranks is not None
            else {}
        ),
    }


def _spmd(lowered: NeuronLowered) -> dict[str, Any]:
    """The per-rank lowering: rank layout (NxD order) and placement, which program each rank
    runs, and the per-core memory estimate of each program."""
    layout = lowered.ranks
    by_rank: dict[int, str] = {}
    for p in lowered.programs:  # a pipelined rank runs several: its first (stage forward)
        for r in p.ranks or ():
            by_rank.setdefault(r, p.key)
    return {
        **layout.to_json(lowered.target),
        "program_of_rank": [by_rank[r] for r in range(layout.world_size)],
        "programs": len(lowered.programs),
        "distinct_programs": "one HLO for every rank"
        if _pipeline(lowered) is None
        else "one HLO per pipeline stage program and transfer (see pipeline)",
        "rank_input": f"programs whose collectives need the rank's coordinate on a mesh axis "
        f"(local_shard) take the NxD rank as their last parameter `{RANK_INPUT}` (int32 scalar, "
        "= the replica id of the executing core; neuronx-cc has no replica-id/partition-id) and "
        "compute coordinate = rank_id / stride % size in the graph; others take no rank input",
        "collectives": "cross-replica (no channel_id): replica_groups list global ranks, one "
        "replica per rank, num_replicas = world_size",
        "memory_per_core": {
            p.key: {"total_bytes": p.memory.total_bytes, "budget_bytes": p.memory.budget_bytes}
            for p in lowered.programs
        },
    }


def _pipeline(lowered: NeuronLowered) -> dict[str, Any] | None:
    """The `pipeline` section of a pipelined step's lowering (pipeline.PipelineLowered)."""
    return getattr(lowered, "pipeline", None)


def _rank_input(prog: NeuronProgram, layout: Any) -> dict[str, Any] | None:
    """How the runtime feeds `prog`'s rank input (None: the program takes none)."""
    if prog.rank_parameter is None:
        return None
    return {
        "parameter": prog.rank_parameter,
        "name": RANK_INPUT,
        "shape": [],
        "dtype": "int32",
        "value": "the NxD rank of the core that runs the program (its replica id)",
        "coordinates": {a: layout.coordinate_formula(a) for a in prog.rank_axes},
    }


def _mx_summary(lowered: NeuronLowered) -> dict[str, Any] | None:
    """How the MX ops and GEMMs of the programs were lowered (None without any): the emulated
    quantize / dequantize ops left, and one decision per MX GEMM (mx_native.py)."""
    names = ("portable.mx_quantize.default", "portable.mx_dequantize.default")
    counts: collections.Counter[str] = collections.Counter(
        str(node.target)
        for prog in lowered.programs
        for node in prog.program.graph.nodes
        if node.op == "call_function" and str(node.target) in names
    )
    gemms = [{"program": p.key, **g.to_json()} for p in lowered.programs for g in p.mx_gemms]
    if not counts and not gemms:
        return None
    native = sum(g["lowering"] == "native" for g in gemms)
    calls: collections.Counter[str] = collections.Counter(
        ins.custom_call_target or ""
        for prog in lowered.programs
        for ins in prog.module.instructions()
        if ins.opcode == "custom-call" and ins.custom_call_target in MX_CALLS
    )
    parts = (["native"] if native else []) + (["emulated-hlo"] if counts or not native else [])
    return {
        "ops": sum(counts.values()),
        "by_op": dict(sorted(counts.items())),
        "lowering": "+".join(parts),  # native, emulated-hlo, or native+emulated-hlo
        **MX_LOWERING,
        "gemms": gemms,
        "native_gemms": native,
        "emulated_gemms": len(gemms) - native,
        **({"custom_calls": dict(sorted(calls.items())), "native": MX_NATIVE} if native else {}),
    }


def _merged_collectives(lowered: NeuronLowered) -> dict[str, Any]:
    counts: collections.Counter[str] = collections.Counter()
    for prog in lowered.programs:
        counts.update(collectives_summary(prog.module)["by_kind"])
    return _summary(counts)


def _verified_offline(lowered: NeuronLowered) -> list[str]:
    jaxlib = _version("jaxlib")
    warnings = sum(len(p.findings) for p in lowered.programs)
    return [
        f"graph.hlo was deserialized by XLA (jaxlib {jaxlib}); its entry root is a tuple",
        f"the offline validator's {len(CHECKS)} checks found 0 errors and {warnings} warning(s) "
        "(listed per program under findings)",
        "parameters and optimizer state are HLO parameters; every updated state output is in "
        "input_output_alias (training steps)",
        f"the HBM estimate is within {lowered.target.name}'s per-core budget "
        f"({lowered.target.hbm_per_core_bytes >> 30} GiB)",
        "portable's test suite (tests/test_neuron.py) checks on the example models that "
        "lowering twice gives byte-identical graph.hlo and that the written graph.hlo, run on "
        "XLA:CPU, matches the cpu backend; this artifact itself was not executed",
    ]


def _dependencies() -> dict[str, str | None]:
    deps: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        deps[name] = _version(name)
    return deps


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None
