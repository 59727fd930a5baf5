"""Offline validator checks of the HLO against the program it lowers (see validate.py): the
entry's interface (one HLO parameter per kept signature input, of its type; the int32 rank
input of a per-rank program last and never donated; training state aliased to its updated
output, nothing else aliased) and the HBM estimate against the target's budget per core."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from portable.ir.signature import TensorSpec

from .findings import Finding
from .hlo import Instruction

if TYPE_CHECKING:
    from .validate import Context

__all__ = ["hbm_budget", "interface"]


def interface(ctx: Context) -> Iterator[Finding]:
    """The HLO's parameters and outputs match the signature; training state is aliased."""
    program, module = ctx.program, ctx.module
    root = module.entry.root
    if root.opcode != "tuple":
        yield ctx.error(
            root,
            "root-not-tuple",
            "the entry computation's root is not a tuple",
            "lower with return_tuple=True (a bug in portable: report it)",
        )
    if program is None:
        return
    params = module.parameters()
    inputs = ctx.inputs
    rank = ctx.rank_parameter
    want_count = len(inputs) + (rank is not None)
    if len(params) != want_count or (rank is not None and rank != len(inputs)):
        extra = " and the int32 rank input" if rank is not None else ""
        yield ctx.error(
            None,
            "parameters",
            f"HLO has {len(params)} parameters for {len(inputs)} signature inputs{extra}",
            "constants or state must not be folded or hoisted, the rank input is the last "
            "parameter (a bug in portable: report it)",
        )
        return
    if rank is not None:
        yield from _rank_parameter(ctx, params[rank])
        params = params[:rank]
    for param, spec in zip(params, inputs, strict=True):
        want = _hlo_type(spec.spec)
        got = str(param.leaves[0]) if len(param.leaves) == 1 else param.type_text
        if got != want:
            yield ctx.error(
                param,
                "parameter-type",
                f"HLO parameter {param.parameter_number} is {got}, input `{spec.name}` is {want}",
                "a bug in portable's lowering: report it",
            )
    # input_output_alias must be the signature's aliasing: updated output k replaces input i
    number = {spec.name: n for n, spec in enumerate(inputs)}
    actual = {a.output_index: a.parameter for a in module.aliases if not a.parameter_index}
    sig = program.signature
    for index, out in enumerate(sig.outputs):
        if out.aliases is None:
            if (index,) in actual:
                yield ctx.error(
                    params[actual[(index,)]],
                    "unexpected-alias",
                    f"output `{out.name}` ({out.kind.value}) aliases HLO parameter "
                    f"{actual[(index,)]} but replaces no input",
                    "a bug in portable's lowering: report it",
                )
        elif actual.get((index,)) != number.get(out.aliases) or out.aliases not in number:
            spec = next(i for i in sig.inputs if i.name == out.aliases)
            yield ctx.error(
                params[number[out.aliases]] if out.aliases in number else None,
                "state-not-aliased",
                f"state input `{spec.name}` ({spec.kind.value}) is not an HLO parameter aliased "
                f"to its updated output `{out.name}` (input_output_alias)",
                "parameters and optimizer state must be donated parameters, never constants "
                "(a bug in portable's lowering: report it)",
                **({} if out.aliases in number else {"node": spec.name, "module": spec.target}),
            )


def _rank_parameter(ctx: Context, param: Instruction) -> Iterator[Finding]:
    """The rank input: an int32 scalar, never donated (every step reads the same rank)."""
    got = str(param.leaves[0]) if len(param.leaves) == 1 else param.type_text
    if got != "s32[]":
        yield ctx.error(
            param,
            "rank-parameter-type",
            f"the rank input (HLO parameter {param.parameter_number}) is {got}, not s32[]",
            "a bug in portable's lowering: report it",
        )
    if any(a.parameter == param.parameter_number for a in ctx.module.aliases):
        yield ctx.error(
            param,
            "rank-parameter-aliased",
            f"the rank input (HLO parameter {param.parameter_number}) is in input_output_alias",
            "a bug in portable's lowering: report it",
        )


def hbm_budget(ctx: Context) -> Iterator[Finding]:
    mem = ctx.memory
    if mem is None:
        return
    gib = 1 << 30
    arithmetic = (
        f"weights {mem.weights_bytes / gib:.2f} + buffers/constants "
        f"{(mem.buffers_bytes + mem.constants_bytes) / gib:.2f} + optimizer state "
        f"{mem.optimizer_state_bytes / gib:.2f} + inputs {mem.inputs_bytes / gib:.2f} + "
        f"gradients {mem.gradients_bytes / gib:.2f} + activations "
        f"{mem.activations_bytes / gib:.2f} = {mem.total_bytes / gib:.2f} GiB vs "
        f"{mem.budget_bytes / gib:.0f} GiB per core on {ctx.target.name}"
    )
    fix = (
        "shard the state (a plan with dp/tp axes, ZeRO-1), use bf16 weights, a smaller "
        "micro-batch, or activation recomputation"
    )
    if mem.total_bytes > mem.budget_bytes:
        yield ctx.error(None, "hbm-budget", f"HBM estimate over budget: {arithmetic}", fix)
    elif mem.total_bytes > (1 - ctx.options.hbm_headroom) * mem.budget_bytes:
        yield ctx.warning(
            None,
            "hbm-headroom",
            f"HBM estimate within {ctx.options.hbm_headroom:.0%} of the budget: {arithmetic}",
            fix,
        )


def _hlo_type(spec: TensorSpec) -> str:
    element = _HLO_ELEMENTS.get(spec.dtype, str(spec.dtype))
    return f"{element}[{','.join(str(d) for d in spec.shape)}]"


_HLO_ELEMENTS = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "s64",
    torch.int32: "s32",
    torch.int16: "s16",
    torch.int8: "s8",
    torch.uint8: "u8",
    torch.bool: "pred",
    torch.float8_e4m3fn: "f8e4m3fn",
    torch.float8_e5m2: "f8e5m2",
}
