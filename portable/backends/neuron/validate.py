"""Offline validator: what neuronx-cc would reject (or compute differently), found before compiling.

Runs on the HLO module read back from the written proto, on every neuron lowering. Each check is a
function `check(ctx) -> findings`; `CHECKS` lists them in order. Errors (dynamic shapes, opcodes
or custom calls outside the allow-lists, `conditional`, `while` without a constant trip count,
variadic reduce, non-default RNG, windows, shifts and sort comparators the compiler refuses,
number formats the generation lacks, state that is not an aliased parameter, HBM over budget)
stop the lowering; warnings (int64 values not proved to fit 32 bits, integer work computed in
FP32, graph size, HBM headroom) go into the manifest. Each rule cites its source (an NCC code of
the Neuron error-code reference, or the page it comes from): docs/backends/neuron.md lists them.
Single-operation rules live in validate_ops.py, collectives in validate_collectives.py, the
program interface and HBM in validate_program.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from portable.ir.program import Program
from portable.ir.signature import InputSpec

from .collectives import rank_layout
from .findings import Finding, Locator, NeuronValidationError, Place, Severity, merge
from .hlo import HloModule, Instruction
from .int_ranges import IntRanges
from .loops import constant_trip_count
from .memory import MemoryEstimate, estimate_memory
from .options import NeuronOptions
from .targets import NeuronTarget
from .validate_collectives import COLLECTIVES, collectives
from .validate_mx import mx_custom_calls
from .validate_ops import constants, dtypes, shifts, sorts, windows
from .validate_program import hbm_budget, interface

__all__ = [
    "ALLOWED_CUSTOM_CALLS",
    "ALLOWED_OPCODES",
    "CHECKS",
    "COLLECTIVES",
    "check_findings",
    "validate",
    "validate_lowered",
]

ALLOWED_OPCODES = frozenset(
    """
    abs add and atan2 bitcast bitcast-convert broadcast call cbrt ceil clamp clz compare
    count-leading-zeros
    concatenate constant convert convolution copy cosine custom-call divide dot dynamic-slice
    dynamic-update-slice erf exponential exponential-minus-one floor gather get-tuple-element iota
    is-finite log log-plus-one logistic maximum minimum multiply negate not optimization-barrier or
    pad parameter popcnt power reduce reduce-window remainder reshape reverse rng rng-bit-generator
    round-nearest-afz round-nearest-even rsqrt scatter select select-and-scatter shift-left
    shift-right-arithmetic shift-right-logical sign sine slice sort sqrt subtract tan tanh
    transpose tuple while xor
    all-reduce all-gather reduce-scatter all-to-all collective-permute
    all-reduce-start all-reduce-done all-gather-start all-gather-done
    collective-permute-start collective-permute-done
    """.split()
)


ALLOWED_CUSTOM_CALLS = frozenset(
    """
    AwsNeuronErf AwsNeuronGelu AwsNeuronGeluApprxTanh AwsNeuronGeluBackward AwsNeuronSilu
    AwsNeuronSiluBackward AwsNeuronRmsNorm AwsNeuronSoftmax AwsNeuronSoftmaxBackward
    AwsNeuronCollectiveMatmul AwsNeuronIntMatmult AwsNeuronArgMax AwsNeuronArgMin AwsNeuronTopK
    AwsNeuronDropoutMaskV1 AwsNeuronCustomNativeKernel AwsNeuronCustomOp AwsNeuronDevicePrint
    ResizeNearest ResizeBilinear ResizeNearestGrad AwsNeuronLNCShardingConstraint
    AwsNeuronTransferWithStaticRing
    AwsNeuronModuleMarkerStart-Forward AwsNeuronModuleMarkerStart-Backward
    AwsNeuronModuleMarkerEnd-Forward AwsNeuronModuleMarkerEnd-Backward
    NeuronBoundaryMarker-Start NeuronBoundaryMarker-End
    """.split()
)  # exactly the targets NCC_EHCA005 / NCC_EVRF015 list (Neuron 2.32 error-code reference)
_UNKNOWN_CUSTOM_CALL = "NCC_EHCA005 or NCC_EVRF015"  # both pages, same message and list
_MX_CUSTOM_CALLS = frozenset({"QuantizeMX", "__op$block_scaled_dot"})  # Trn3 MX only

# opcodes with a dedicated explanation; anything else off the allow-list is "unsupported-opcode"
_DENIED = {
    "conditional": (
        "`conditional` (lax.cond / data-dependent branch) is not supported by neuronx-cc",
        "compute both branches and select with torch.where, or move the branch to the host "
        "and capture one program per branch",
    ),
    "replica-id": (
        "`replica-id` is not supported: neuronx-cc does not provide the rank",
        "pass the rank id as an int32 input",
    ),
    "partition-id": (
        "`partition-id` is not supported: neuronx-cc does not provide the rank",
        "pass the rank id as an int32 input",
    ),
    "reduce-precision": (
        "`reduce-precision` is not supported by neuronx-cc",
        "cast to the narrower dtype and back explicitly (convert)",
    ),
}
_SHARDING_CALLS = frozenset({"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
_HOST = frozenset({"infeed", "outfeed", "send", "send-done", "recv", "recv-done", "after-all"})
_DYNAMIC = frozenset({"set-dimension-size", "get-dimension-size", "dynamic-reshape"})


@dataclasses.dataclass(frozen=True)
class Context:
    module: HloModule
    target: NeuronTarget
    options: NeuronOptions
    program: Program | None
    inputs: tuple[InputSpec, ...]  # the signature input of each HLO parameter (program given)
    memory: MemoryEstimate | None
    locator: Locator
    ranks: Any = None  # collectives.RankLayout of a per-rank program (world size, axis sizes)
    rank_parameter: int | None = None  # parameter number of the int32 rank input, if any

    def finding(
        self,
        ins: Instruction | None,
        severity: Severity,
        code: str,
        what: str,
        fix: str,
        ncc: str | None = None,
    ) -> Finding:
        place: Place = self.locator.place(ins) if ins is not None else {}
        return Finding(severity, code, what, fix, **place, ncc=ncc)

    def error(
        self, ins: Instruction | None, code: str, what: str, fix: str, ncc: str | None = None
    ) -> Finding:
        return self.finding(ins, Severity.ERROR, code, what, fix, ncc)

    def warning(
        self, ins: Instruction | None, code: str, what: str, fix: str, ncc: str | None = None
    ) -> Finding:
        return self.finding(ins, Severity.WARNING, code, what, fix, ncc)


Check = Callable[[Context], Iterator[Finding]]


def validate(
    module: HloModule,
    target: NeuronTarget,
    options: NeuronOptions | None = None,
    *,
    program: Program | None = None,
    kept: Sequence[int] | None = None,
    memory: MemoryEstimate | None = None,
    ranks: Any = None,
    rank_parameter: int | None = None,
) -> list[Finding]:
    """Every finding about `module` for `target` (errors first, same-node findings folded).

    With `program`, findings name its nodes and source lines, and the HLO's parameters are
    checked against its signature; `kept` lists the signature inputs that are HLO parameters
    (default: all). `memory` enables the HBM check; `ranks` (collectives.RankLayout) the replica
    group checks of a per-rank program; `rank_parameter` the number of its int32 rank input (the
    last parameter, after the kept inputs; replica-id / partition-id stay errors)."""
    inputs: tuple[InputSpec, ...] = ()
    if program is not None:
        sig_inputs = program.signature.inputs
        inputs = tuple(sig_inputs[k] for k in (range(len(sig_inputs)) if kept is None else kept))
    locator = Locator.of(module, program, kept, rank_parameter is not None)
    ctx = Context(
        module,
        target,
        options or NeuronOptions(),
        program,
        inputs,
        memory,
        locator,
        ranks,
        rank_parameter,
    )
    return merge(f for check in CHECKS for f in check(ctx))


def validate_lowered(
    module: HloModule,
    target: NeuronTarget,
    options: NeuronOptions,
    program: Program,
    *,
    kept: Sequence[int] | None = None,
    rank_parameter: int | None = None,
) -> tuple[list[Finding], MemoryEstimate]:
    """`validate` in the context a lowering produced `module` in: `program` as lowered (after
    the fp64 downcast), its HBM estimate, and for a per-rank program its rank layout and rank
    input. The one place that context is built: the neuron backend validates every lowering
    with it, and `portable check` re-validates written artifacts with it."""
    memory = estimate_memory(program, module, target, kept)
    findings = validate(
        module,
        target,
        options,
        program=program,
        kept=kept,
        memory=memory,
        ranks=rank_layout(program),
        rank_parameter=rank_parameter,
    )
    return findings, memory


def check_findings(findings: list[Finding], *, program: str, target: str) -> None:
    """Raise NeuronValidationError (listing all findings) if any finding is an error."""
    if any(f.severity is Severity.ERROR for f in findings):
        raise NeuronValidationError(findings, program=program, target=target)


# -- checks ------------------------------------------------------------------------------------


def static_shapes(ctx: Context) -> Iterator[Finding]:
    for ins in _values(ctx.module):
        dynamic = [leaf for leaf in ins.leaves if not leaf.is_static]
        if dynamic or ins.opcode in _DYNAMIC:
            shown = ", ".join(str(leaf) for leaf in dynamic) or ins.opcode
            yield ctx.error(
                ins,
                "dynamic-shape",
                f"dynamic shape {shown}: neuronx-cc compiles static shapes only",
                "capture one program per shape bucket (pad inputs to the bucket size)",
                ncc="NCC_EMOD025",
            )


def opcodes(ctx: Context) -> Iterator[Finding]:
    for ins in ctx.module.instructions():
        op = ins.opcode
        if op in ALLOWED_OPCODES or op in _DYNAMIC:
            continue
        if op in _DENIED:
            what, fix = _DENIED[op]
            yield ctx.error(ins, op, what, fix, ncc="NCC_EVRF001")
        elif op in _HOST:
            yield ctx.error(
                ins,
                "host-transfer",
                f"`{op}` moves data to or from the host inside the program",
                "remove host callbacks / prints / infeed from the step; return the values instead",
                ncc="NCC_EVRF001",
            )
        else:
            yield ctx.error(
                ins,
                "unsupported-opcode",
                f"opcode `{op}` is not on the Neuron allow-list",
                "rewrite the op with supported HLO (see docs/backends/neuron.md), or add a "
                "neuron lowering override in backends/xla/rules",
                ncc="NCC_EVRF001",
            )


def control_flow(ctx: Context) -> Iterator[Finding]:
    for ins in ctx.module.instructions():
        if ins.opcode == "while" and not constant_trip_count(ctx.module, ins):
            yield ctx.error(
                ins,
                "unbounded-while",
                "`while` without a constant trip count (data-dependent loop)",
                "loop a fixed number of times (fori_loop / scan with static bounds, or unroll) "
                "and mask the extra iterations",
                # no NCC code published: JAX NeuronX known issues (static while loops only)
            )


def reductions(ctx: Context) -> Iterator[Finding]:
    for ins in ctx.module.instructions():
        if ins.opcode == "reduce" and ins.is_tuple:
            yield ctx.error(
                ins,
                "variadic-reduce",
                f"variadic reduce over {len(ins.leaves)} operands (argmax/argmin-style)",
                "reduce one operand at a time (max, then the first index equal to it via a "
                "second reduce), or use AwsNeuronArgMax/ArgMin through a neuron override",
                # no NCC code published: JAX NeuronX known issues (variadic reductions)
            )


def random_numbers(ctx: Context) -> Iterator[Finding]:
    for ins in ctx.module.instructions():
        algorithm = ins.attrs.get("algorithm", "rng_default")
        if ins.opcode == "rng-bit-generator" and algorithm != "rng_default":
            yield ctx.error(
                ins,
                "rng-algorithm",
                f"rng-bit-generator with algorithm {algorithm}; neuronx-cc takes the default only",
                "use the default algorithm (JAX: the `rbg` PRNG implementation)",
                ncc="NCC_EVRF006",
            )


def custom_calls(ctx: Context) -> Iterator[Finding]:
    for ins in ctx.module.instructions():
        if ins.opcode != "custom-call":
            continue
        name = ins.custom_call_target or ""
        if name in ALLOWED_CUSTOM_CALLS:
            continue
        if name in _MX_CUSTOM_CALLS:
            if not ctx.target.mx:
                yield ctx.error(
                    ins,
                    "mx-target",
                    f"MX custom call {name} needs Trainium3 (neuron:{ctx.target.name} has no MX)",
                    "lower for neuron:trn3, or drop the mx-quantize pass for this target",
                )
            continue
        if name.startswith("xla.sdy.") or name in _SHARDING_CALLS:
            what = f"sharding annotation `{name}`: this is pre-partitioning HLO"
            fix = (
                "neuronx-cc does not partition: apply the spmd-partition pass so each rank's "
                "program has explicit collectives"
            )
        elif "callback" in name:
            what = f"host callback `{name}` inside the program"
            fix = "remove host callbacks (print, debug, pure_callback) from the captured step"
        else:
            what = f"custom call `{name}` is not one of the targets neuronx-cc recognises"
            fix = (
                "lower the op with standard HLO or an allow-listed custom call "
                "(validate.ALLOWED_CUSTOM_CALLS; marker names are exact, e.g. "
                "AwsNeuronModuleMarkerStart-Forward)"
            )
        yield ctx.error(ins, "custom-call", what, fix, ncc=_UNKNOWN_CUSTOM_CALL)


def int64_values(ctx: Context) -> Iterator[Finding]:
    ranges = IntRanges(ctx.module)
    for ins in ranges.unproved():
        known = ranges.interval(ins)
        shown = f" (known range [{known.lo}, {known.hi}])" if known is not None else ""
        yield ctx.warning(
            ins,
            "int64-downcast",
            f"int64 value not proved to fit in 32 bits{shown}: with --native-int64=disabled "
            "(and always on trn1) neuronx-cc computes it in int32, so values beyond 2^31 wrap",
            "keep the values below 2^31 (int64 indices into tables and counters over static "
            "shapes are proved safe), or compute them in int32 explicitly",
        )


def fp32_accumulation(ctx: Context) -> Iterator[Finding]:
    for ins in ctx.module.instructions():
        integer = any(e[0] in "su" for e in ins.elements)
        kind = ncc = None
        if ins.opcode in ("dot", "convolution") and integer:
            kind, ncc = f"integer {ins.opcode}", "NCC_EVRF035"
        elif ins.opcode == "scatter" and integer and _combiner(ctx.module, ins) == "add":
            kind, ncc = "integer scatter-add", "NCC_EVRF060"
        elif ins.opcode in ("all-reduce", "all-reduce-start") and integer:
            kind, ncc = f"integer {ins.opcode}", "NCC_EVRF061"
        elif ins.opcode == "reduce-scatter" and integer:
            kind, ncc = "integer reduce-scatter", "NCC_EVRF063"
        if kind:
            # with the pinned --implicit-integer-downcast=all the compiler warns; with =none
            # (the announced next default) these are the errors named by `ncc`
            yield ctx.warning(
                ins,
                "fp32-accumulation",
                f"{kind}: Neuron computes it in FP32, exact only below 2^24",
                "keep the integer values below 2^24, or compute in float32 explicitly",
                ncc=ncc,
            )


def graph_size(ctx: Context) -> Iterator[Finding]:
    count = ctx.module.instruction_count
    if count > ctx.options.max_instructions:
        yield ctx.warning(
            None,
            "graph-size",
            f"{count} HLO instructions (> {ctx.options.max_instructions}, a heuristic: no HLO "
            "instruction limit is published): compile time and host memory grow with size, "
            "and the instructions neuronx-cc generates from it have a limit",
            "cut the model into pipeline stages (a plan with a pp axis) or fewer layers per "
            "program",
            ncc="NCC_EVRF007",  # the limit on generated instructions (also EBVF030, EXTP004)
        )


CHECKS: tuple[Check, ...] = (
    static_shapes,
    opcodes,
    control_flow,
    reductions,
    random_numbers,
    windows,
    shifts,
    sorts,
    custom_calls,
    mx_custom_calls,
    dtypes,
    constants,
    int64_values,
    fp32_accumulation,
    collectives,
    graph_size,
    interface,
    hbm_budget,
)


# -- helpers -----------------------------------------------------------------------------------


def _values(module: HloModule) -> Iterator[Instruction]:
    """Instructions that make a value (not tuples and tuple projections, which pass one on)."""
    for ins in module.instructions():
        if ins.opcode not in ("tuple", "get-tuple-element"):
            yield ins


def _combiner(module: HloModule, ins: Instruction) -> str | None:
    comp = module.computation(ins.called("to_apply") or "")
    return comp.root.opcode if comp is not None else None
