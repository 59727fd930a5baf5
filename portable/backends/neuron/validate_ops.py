"""Validator checks of single operations: convolution and reduce-window windows, arithmetic right
shifts, sort comparators, and number formats per target (float64, complex, FP8, FP4).

Each rule cites its source: an NCC code of the Neuron compiler error-code reference
(compiler/error-codes/<CODE>.html), the Neuron 2.32 compiler release notes (complex64), the
Neuron data-types page, or the JAX NeuronX known issues (sort comparators) where no code exists.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .findings import Finding
from .hlo import ELEMENT_BITS, Instruction
from .options import NeuronOptions
from .targets import NeuronTarget

if TYPE_CHECKING:
    from .validate import Context

__all__ = ["C64_OPCODES", "FP8_FORMATS", "constants", "dtypes", "shifts", "sorts", "windows"]

# Neuron 2.32 compiler release notes: complex64 is supported on these operations (StableHLO
# names mapped to HLO opcodes: broadcast_in_dim -> broadcast, dot_general -> dot, and the
# underscores of log_plus_one etc. -> hyphens). Parameters and tuple plumbing compute nothing.
C64_OPCODES = frozenset(
    """add subtract multiply divide compare abs exponential sine cosine reshape complex real imag
    dot broadcast iota negate power log log-plus-one exponential-minus-one sqrt rsqrt tan tanh
    logistic sign select transpose reverse slice dynamic-slice dynamic-update-slice concatenate
    pad""".split()
)
_PLUMBING = frozenset({"parameter", "tuple", "get-tuple-element"})

# HLO FP8 element type -> how a message names it
FP8_FORMATS = {
    "f8e4m3fn": "float8_e4m3fn (max 448)",
    "f8e4m3": "float8_e4m3 (max 240)",
    "f8e5m2": "float8_e5m2",
    "f8e3m4": "float8_e3m4",
}
_FNUZ = ("f8e4m3fnuz", "f8e4m3b11fnuz", "f8e5m2fnuz")
_SORT_DIRECTIONS = frozenset({"LT", "LE", "GT", "GE"})
_U32_MAX = (1 << 32) - 1


def windows(ctx: Context) -> Iterator[Finding]:
    """Convolution: input and kernel dilation together (NCC_EVRF010), input dilation with a
    stride (NCC_EVRF011). Reduce-window: other than one input and one init value
    (NCC_EVRF019), base dilation (NCC_EVRF017), window dilation (NCC_EVRF018)."""
    for ins in ctx.module.instructions():
        if ins.opcode == "convolution":
            yield from _convolution(ctx, ins)
        elif ins.opcode == "reduce-window":
            yield from _reduce_window(ctx, ins)


def _convolution(ctx: Context, ins: Instruction) -> Iterator[Finding]:
    window = _window(ins.attrs.get("window", ""))
    lhs, rhs = _dilated(window.get("lhs_dilate")), _dilated(window.get("rhs_dilate"))
    if lhs and rhs:
        yield ctx.error(
            ins,
            "conv-dilation",
            "convolution with both input (lhs) and kernel (rhs) dilation",
            "split it: dilate the input explicitly (pad/scatter), then a conv with only "
            "kernel dilation",
            ncc="NCC_EVRF010",
        )
    if lhs and _dilated(window.get("stride")):
        yield ctx.error(
            ins,
            "conv-stride-dilation",
            f"strided convolution (stride {window['stride']}) with input (lhs) dilation "
            f"{window['lhs_dilate']} (a strided transposed convolution)",
            "drop the stride or the input dilation: upsample the input explicitly (pad/scatter) "
            "and convolve without dilation, or convolve with stride 1 and subsample after",
            ncc="NCC_EVRF011",
        )


def _reduce_window(ctx: Context, ins: Instruction) -> Iterator[Finding]:
    if ins.is_tuple or len(ins.operands) != 2:
        yield ctx.error(
            ins,
            "variadic-reduce-window",
            f"reduce-window over {len(ins.operands)} operands; neuronx-cc takes exactly one "
            "input and one init value",
            "split it into one single-operand reduce-window per input",
            ncc="NCC_EVRF019",
        )
    window = _window(ins.attrs.get("window", ""))
    for key, what, ncc in (
        ("lhs_dilate", "base (input) dilation", "NCC_EVRF017"),
        ("rhs_dilate", "window dilation", "NCC_EVRF018"),
    ):
        if _dilated(window.get(key)):
            yield ctx.error(
                ins,
                "reduce-window-dilation",
                f"reduce-window (pooling) with {what} {window[key]}",
                "use an undilated window (dilate or gather the elements explicitly first)",
                ncc=ncc,
            )


def shifts(ctx: Context) -> Iterator[Finding]:
    """shift-right-arithmetic on a value that is not 32-bit (NCC_EVRF022; the page makes no
    exception for int64 under --native-int64=disabled)."""
    for ins in ctx.module.instructions():
        if ins.opcode != "shift-right-arithmetic" or not ins.leaves:
            continue
        element = ins.leaves[0].element
        if ELEMENT_BITS.get(element) != 32:
            yield ctx.error(
                ins,
                "shift-width",
                f"arithmetic right shift of {element}: neuronx-cc shifts 32-bit values only",
                "convert the shifted value to int32 (or uint32) before the shift and back after",
                ncc="NCC_EVRF022",
            )


def sorts(ctx: Context) -> Iterator[Finding]:
    """A sort whose comparator is not one LT / LE / GT / GE compare (JAX NeuronX known issues:
    "jax.lax.sort only supports comparators with LE, GE, LT and GT"; no NCC code published).

    Read as: the comparator's root is such a compare. JAX's float comparator (jnp.sort, argsort,
    portable's sort / topk rules) is `compare(..., direction=LT, type=TOTALORDER)` over keys
    canonicalized with EQ / NE selects (-0.0 to 0.0, NaN to one NaN): accepted. Sorting on
    several keys (num_keys > 1) makes the root an `or`/`and`/`select` chain: refused."""
    for ins in ctx.module.instructions():
        if ins.opcode != "sort":
            continue
        comparator = ctx.module.computation(ins.called("to_apply") or "")
        root = comparator.root if comparator is not None else None
        direction = root.attrs.get("direction") if root is not None else None
        if root is not None and root.opcode == "compare" and direction in _SORT_DIRECTIONS:
            continue
        shown = f"compare {direction}" if direction else (root.opcode if root else "unknown")
        yield ctx.error(
            ins,
            "sort-comparator",
            f"sort comparator ends in `{shown}`; neuronx-cc sorts with one LT / LE / GT / GE "
            "comparison only",
            "sort on one key (fold several keys into one, e.g. key * n + secondary, or sort "
            "stably on the secondary key first, then on the primary key with num_keys=1)",
        )


def constants(ctx: Context) -> Iterator[Finding]:
    """A u64 constant above 2^32 - 1, which the compiler cannot convert to 32 bits
    (NCC_ESFH002). Only constants whose values are printed can be checked (XLA elides large
    ones)."""
    for ins in ctx.module.instructions():
        if ins.opcode != "constant" or [leaf.element for leaf in ins.leaves] != ["u64"]:
            continue
        values = [int(v) for v in re.findall(r"\d+", ins.literal)]
        if values and max(values) > _U32_MAX:
            yield ctx.error(
                ins,
                "u64-constant",
                f"u64 constant {max(values)} does not fit in 32 bits",
                "use uint32 / int32 for the constant, or restructure the code to avoid it",
                ncc="NCC_ESFH002",
            )


def dtypes(ctx: Context) -> Iterator[Finding]:
    """Number formats `ctx.target` lacks, on results and (for complex64) operands."""
    by_name = {c.name: c.by_name() for c in ctx.module.computations}
    for ins in ctx.module.instructions():
        if ins.opcode in ("tuple", "get-tuple-element"):
            continue
        operands = by_name[ins.computation]
        elements = set(ins.elements)
        if ins.opcode not in _PLUMBING:
            elements |= {
                e for o in ins.operands if o in operands for e in operands[o].elements if e == "c64"
            }
        for element in sorted(elements):
            problem = _dtype_problem(element, ins, ctx.target, ctx.options)
            if problem is not None:
                code, what, fix, ncc = problem
                yield ctx.error(ins, code, what, fix, ncc=ncc)


Problem = tuple[str, str, str, str | None]


def _dtype_problem(
    element: str, ins: Instruction, target: NeuronTarget, options: NeuronOptions
) -> Problem | None:
    """(code, what, fix, ncc) when `element` cannot be used by `ins` on `target`, else None."""
    if element == "f64":
        if options.fp64 == "downcast":
            fix = (
                "the fp64 downcast should have removed it: a lowering rule made float64 "
                "itself (report it); compute in float32 meanwhile"
            )
        else:
            fix = "compute in float32, or lower with NeuronOptions(fp64='downcast')"
        return "dtype-f64", "float64 value: no NeuronCore computes in float64", fix, None
    if element in ("c64", "c128"):
        return _complex(element, ins)
    if element.startswith("f8") or element == "f4e2m1fn":
        return _narrow_float(element, target)
    return None


def _complex(element: str, ins: Instruction) -> Problem | None:
    fix = "split into real and imaginary float parts"
    if element == "c128":
        what = "complex128 value: Neuron computes no complex128 (complex64 on some ops only)"
        return "dtype-complex", what, fix + ", or use complex64", "NCC_EVRF004"
    if ins.opcode in C64_OPCODES or ins.opcode in _PLUMBING:
        return None
    what = (
        f"complex64 in `{ins.opcode}`: Neuron 2.32 computes complex64 only in "
        f"{', '.join(sorted(C64_OPCODES))}"
    )
    if ins.opcode == "constant":
        fix = "build the value with complex(real, imag) from float constants, or " + fix
    return "dtype-complex", what, fix, "NCC_EVRF004"


def _narrow_float(element: str, target: NeuronTarget) -> Problem | None:
    if element in _FNUZ:
        what = f"{element}: FP8 *FNUZ variants are not supported on any NeuronCore"
        return "dtype-fp8-fnuz", what, f"use {_fp8_list(target)}", "NCC_EVRF005"
    if element == "f4e2m1fn":
        what = "raw FP4 (f4e2m1fn) element type: MXFP4 exists only through NKI kernels on Trn3"
        fix = "keep FP4 out of the HLO (bf16, or the target's FP8: " + _fp8_list(target) + ")"
        return "dtype-fp4", what, fix, "NCC_ESPP004"
    if element == "f8e8m0fnu":
        if target.mx:
            return None
        what = f"E8M0 MX scales need Trainium3 (neuron:{target.name} has no MX)"
        return "dtype-fp8", what, "lower for neuron:trn3", None
    if element in target.fp8_types:
        return None
    fix = f"use {_fp8_list(target)} on neuron:{target.name}"
    if element == "f8e4m3fn":
        # NCC_EVRF051; --experimental-unsafe-fp8e4m3fn-as-fp8e4m3 would convert it to e4m3
        what = "float8_e4m3fn (max 448) is not supported on Trn1/Trn2 (Trn3 and later only)"
        return "dtype-fp8", what, fix + ", or lower for neuron:trn3", "NCC_EVRF051"
    if element == "f8e4m3":
        what = f"float8_e4m3 (max 240) is not supported on {target.name} (Trn3 is the last)"
        return "dtype-fp8", what, fix, "NCC_EVRF052"
    if element == "f8e3m4":
        # The data-types page lists FP8_e3m4 among the NeuronCore formats, but no compiler page
        # names F8E3M4 as an accepted HLO type and the JAX NeuronX notes allow only e4m3 / e5m2
        # from JAX, the path this HLO takes: refused until a compiler release documents it.
        what = (
            "float8_e3m4: a NeuronCore format (data-types page), but not a documented HLO input "
            "of neuronx-cc (JAX on Neuron takes e4m3 and e5m2 only)"
        )
        return "dtype-fp8", what, fix, None
    what = f"{element} is not an FP8 format of {target.name}"
    return "dtype-fp8", what, fix, None


def _fp8_list(target: NeuronTarget) -> str:
    names = [FP8_FORMATS[e] for e in FP8_FORMATS if e in target.fp8_types]
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def _window(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.strip("{}").split() if "=" in part)


def _dilated(value: str | None) -> bool:
    """Any factor other than 1 in `2x1`-style text (also used for strides)."""
    return value is not None and any(int(v) != 1 for v in value.split("x") if v.isdigit())
