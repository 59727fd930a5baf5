"""Offline checks of Trainium3's MX custom calls: every rule of the Neuron compiler's error-code
pages NCC_EVRF036..058 (Neuron SDK docs, compiler/error-codes/EVRF0xx), each finding with that
code, on a target with MX (on others `validate.custom_calls` refuses the calls outright).

QuantizeMX (one per quantized operand):
  EVRF036 backend_config missing or not a JSON object (`dim`, `block_size`, `scale_method`
          optional: defaults 0, 32, "EMAX")
  EVRF037 not exactly one operand            EVRF041 operand not BF16 / F16
  EVRF038 `dim` neither the last dim (-1, rank - 1; rank >= 1) nor the second-to-last
          (-2, rank - 2; rank >= 2)
  EVRF039 `block_size` not 32                EVRF040 `scale_method` not "EMAX"
  EVRF042 `dtype` missing or not "float8_e5m2" / "float8_e4m3fn"; data output not U32; data
          of the input's rank whose dims differ from the input's with the quantized dim / 4
  EVRF057 result not a 2-tuple (data, scale)  EVRF058 quantized dim not divisible by 4
__op$block_scaled_dot (one per MX GEMM; `scaled_dot_backend_config` and its fields optional,
the contracting dim defaulting to each operand's last):
  EVRF043 not exactly 4 operands (lhs, rhs, lhs_scale, rhs_scale)
  EVRF044 lhs not U32                        EVRF045 result not F32 / BF16
  EVRF046 lhs rank < 2                       EVRF047 rhs rank < 2
  EVRF048 as many lhs as rhs batch dims, products of their sizes differ
  EVRF049 backend_config not empty, "None" or JSON; a dimension that is not an integer
  EVRF050 first contracting dims of lhs and rhs of different sizes
  EVRF053 the first contracting dim among the operand's batch dims
  EVRF054 a batch dim outside [0, rank)      EVRF055 the first contracting dim outside [0, rank)
Our own rules, without a documented code (ncc None): the quantized dim a multiple of the
block (32); the rhs U32 like the lhs; `element_dtype`, when given, an FP8 name QuantizeMX makes.
Warnings for what the pages leave open, in the layout portable assumes (mx_calls.py): QuantizeMX's
scales u8 with the quantized dim / 32; block_scaled_dot's operands QuantizeMX's outputs (data,
data, scales, scales: get-tuple-element 0, 0, 1, 1).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .findings import Finding
from .hlo import ArrayType, Instruction

if TYPE_CHECKING:
    from .validate import Context

__all__ = ["MX_CALLS", "mx_custom_calls"]

QUANTIZE_MX = "QuantizeMX"
SCALED_DOT = "__op$block_scaled_dot"
MX_CALLS = frozenset({QUANTIZE_MX, SCALED_DOT})
FP8_NAMES = ("float8_e5m2", "float8_e4m3fn")
_INPUTS = ("bf16", "f16")
_RESULTS = ("f32", "bf16")
_BLOCK = 32
_QFIX = "QuantizeMX: one bf16/f16 operand, backend_config "
_Q_EXAMPLE = '{"block_size":32,"dim":-1,"dtype":"float8_e4m3fn","scale_method":"EMAX"}'


def mx_custom_calls(ctx: Context) -> Iterator[Finding]:
    """Every EVRF036..058 rule on each QuantizeMX / __op$block_scaled_dot (targets with MX)."""
    if not ctx.target.mx:
        return
    for comp in ctx.module.computations:
        by_name = comp.by_name()
        for ins in comp.instructions:
            if ins.opcode != "custom-call" or ins.custom_call_target not in MX_CALLS:
                continue
            operands = [_array(by_name.get(name)) for name in ins.operands]
            if ins.custom_call_target == QUANTIZE_MX:
                problems = _quantize(ins, operands)
            else:
                problems = _scaled_dot(ins, operands)
            code = "mx-quantize" if ins.custom_call_target == QUANTIZE_MX else "mx-scaled-dot"
            for ncc, what, fix in problems:
                yield ctx.error(ins, code, what, fix, ncc=f"NCC_{ncc}" if ncc else None)
            for what, fix in _layout(ins, by_name, operands):
                yield ctx.warning(ins, code, what, fix)


Problem = tuple[str | None, str, str]


def _array(ins: Instruction | None) -> ArrayType | None:
    """The array an operand is (None for a tuple or an unknown name)."""
    if ins is None or ins.is_tuple or len(ins.leaves) != 1:
        return None
    return ins.leaves[0]


def _config(ins: Instruction) -> tuple[str | None, Any]:
    """(raw backend_config text or None, its JSON value or the json error)."""
    raw = ins.attrs.get("backend_config")
    if raw is None:
        return None, None
    raw = raw.strip()
    if raw.startswith('"'):
        raw = json.loads(raw)  # XLA prints a non-JSON config as a quoted, escaped string
    try:
        return raw, json.loads(raw)
    except (json.JSONDecodeError, TypeError) as exc:
        return raw, exc


# ---------------------------------------------------------------------- QuantizeMX


def _quantize(ins: Instruction, operands: list[ArrayType | None]) -> list[Problem]:
    out: list[Problem] = []
    raw, config = _config(ins)
    if raw is None or not isinstance(config, dict):
        shown = "missing" if raw is None else f"{raw[:60]!r} is not a JSON object"
        out.append(("EVRF036", f"QuantizeMX backend_config {shown}", f"{_QFIX}{_Q_EXAMPLE}"))
        config = {}
    if len(operands) != 1:
        out.append(
            (
                "EVRF037",
                f"QuantizeMX has {len(operands)} operands; it takes exactly 1 (the input tensor)",
                "pass exactly one input tensor",
            )  # fmt: skip
        )
    x = operands[0] if len(operands) == 1 else None
    if x is not None and x.element not in _INPUTS:
        out.append(
            (
                "EVRF041",
                f"QuantizeMX input is {x.element}; it quantizes BF16 or F16 only",
                "cast the input to bf16 or f16 first (capture with precision compute=bfloat16)",
            )  # fmt: skip
        )
    block, method = config.get("block_size", _BLOCK), config.get("scale_method", "EMAX")
    if block != _BLOCK:
        out.append(
            ("EVRF039", f"QuantizeMX block_size {block!r}; it must be 32", "use block_size=32")
        )
    if method != "EMAX":
        out.append(
            (
                "EVRF040",
                f'QuantizeMX scale_method {method!r}; only "EMAX" is supported',
                'use "scale_method": "EMAX" (mx-quantize{scale=emax})',
            )  # fmt: skip
        )
    dtype = config.get("dtype")
    if dtype not in FP8_NAMES:
        what = "missing" if dtype is None else f"{dtype!r}"
        out.append(
            (
                "EVRF042",
                f'QuantizeMX dtype {what}: it must be "float8_e5m2" or "float8_e4m3fn"',
                'set "dtype" to "float8_e4m3fn" or "float8_e5m2"',
            )  # fmt: skip
        )
    out += _quantize_shapes(ins, x, config.get("dim", 0))
    return out


def _quantize_dim(x: ArrayType, dim: Any) -> int | None:
    """The non-negative quantized dim, or None if `dim` is not one EVRF038 allows."""
    rank = len(x.dims)
    allowed = {-1: rank - 1, rank - 1: rank - 1} if rank >= 1 else {}
    if rank >= 2:
        allowed.update({-2: rank - 2, rank - 2: rank - 2})
    return allowed.get(dim) if isinstance(dim, int) and not isinstance(dim, bool) else None


def _quantize_shapes(ins: Instruction, x: ArrayType | None, dim: Any) -> list[Problem]:
    out: list[Problem] = []
    if not ins.is_tuple or len(ins.leaves) != 2:
        out.append(
            (
                "EVRF057",
                f"QuantizeMX returns {ins.type_text}; it must return a 2-tuple "
                "(quantized_data, scale)",
                "declare the result (u32[...], u8[...])",
            )  # fmt: skip
        )
    if x is None:
        return out
    d = _quantize_dim(x, dim)
    if d is None:
        out.append(
            (
                "EVRF038",
                f"QuantizeMX dim {dim!r} is invalid for a rank-{len(x.dims)} input: "
                "only the last dim (-1) or, for rank >= 2, the second-to-last (-2)",
                "use dim=-1 (rank - 1), or dim=-2 (rank - 2) for rank >= 2",
            )  # fmt: skip
        )
        return out
    size = x.dims[d]
    if size % 4:
        out.append(
            (
                "EVRF058",
                f"QuantizeMX quantized dim {d} has size {size}, not divisible by 4 "
                f"({size} % 4 = {size % 4})",
                "pad the quantized dim to a multiple of 4",
            )  # fmt: skip
        )
    elif size % _BLOCK:
        out.append(
            (
                None,
                f"QuantizeMX quantized dim {d} has size {size}, not a multiple of the block "
                f"({size} % {_BLOCK} = {size % _BLOCK}): the last block would be partial",
                "pad the quantized dim to a multiple of 32",
            )  # fmt: skip
        )
    if ins.is_tuple and ins.leaves:
        data = ins.leaves[0]
        want = tuple(s // 4 if k == d else s for k, s in enumerate(x.dims))
        if data.element != "u32":
            out.append(
                (
                    "EVRF042",
                    f"QuantizeMX quantized_data is {data.element}; it must be U32 (four "
                    "packed FP8 values per element)",
                    "declare quantized_data as u32",
                )  # fmt: skip
            )
        if len(data.dims) == len(x.dims) and data.dims != want:
            out.append(
                (
                    "EVRF042",
                    f"QuantizeMX quantized_data shape {list(data.dims)} for input "
                    f"{list(x.dims)} along dim {d}: expected {list(want)} (dim {d} / 4)",
                    f"declare quantized_data as u32{list(want)}",
                )  # fmt: skip
            )
    return out


# ---------------------------------------------------------------------- block-scaled dot


def _dims(config: dict[str, Any], key: str) -> list[int]:
    value = config.get(key, [])
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _dot_config(ins: Instruction) -> tuple[dict[str, Any] | None, Problem | None]:
    """The scaled_dot_backend_config as a dict with int dim lists, or the EVRF049 problem."""
    raw, config = _config(ins)
    fix = "write valid JSON with integer lists, or leave backend_config empty"
    if raw is None or raw in ("", "None"):
        config = {}
    elif isinstance(config, Exception) or not isinstance(config, dict):
        return None, ("EVRF049", f"block_scaled_dot backend_config {raw[:60]!r} is not JSON", fix)
    inner = config.get("scaled_dot_backend_config", {})
    if not isinstance(inner, dict):
        return None, ("EVRF049", "scaled_dot_backend_config is not a JSON object", fix)
    parsed: dict[str, Any] = {"element_dtype": inner.get("element_dtype", "")}
    for side in ("lhs", "rhs"):
        for kind in ("batch", "contracting"):
            key = f"{side}_{kind}_dimensions"
            try:
                parsed[key] = _dims(inner, key)
            except (TypeError, ValueError):
                return None, ("EVRF049", f"{key} {inner.get(key)!r} holds a non-integer", fix)
    return parsed, None


def _scaled_dot(ins: Instruction, operands: list[ArrayType | None]) -> list[Problem]:
    out: list[Problem] = []
    if len(operands) != 4:
        out.append(
            (
                "EVRF043",
                f"block_scaled_dot has {len(operands)} operands; it takes exactly 4 "
                "(lhs, rhs, lhs_scale, rhs_scale)",
                "pass lhs, rhs, lhs_scale, rhs_scale (QuantizeMX's data and scales)",
            )  # fmt: skip
        )
    result = ins.leaves[0] if len(ins.leaves) == 1 and not ins.is_tuple else None
    if result is None or result.element not in _RESULTS:
        shown = result.element if result is not None else ins.type_text
        out.append(
            (
                "EVRF045",
                f"block_scaled_dot result is {shown}; only F32 or BF16",
                "declare the result f32 or bf16 (convert after the dot)",
            )  # fmt: skip
        )
    config, problem = _dot_config(ins)
    if problem is not None:
        out.append(problem)
    lhs, rhs = (operands + [None, None])[:2]
    for side, array, ncc in (("lhs", lhs, "EVRF046"), ("rhs", rhs, "EVRF047")):
        if array is not None and len(array.dims) < 2:
            out.append(
                (
                    ncc,
                    f"block_scaled_dot {side.upper()} has rank {len(array.dims)}; it must "
                    "have rank >= 2",
                    f"reshape the {side} to at least 2 dims",
                )  # fmt: skip
            )
    if lhs is not None and lhs.element != "u32":
        out.append(
            (
                "EVRF044",
                f"block_scaled_dot LHS is {lhs.element}; it must be U32 (QuantizeMX's packed data)",
                "pass QuantizeMX's quantized_data (u32) as the lhs",
            )  # fmt: skip
        )
    if rhs is not None and rhs.element != "u32":
        out.append(
            (
                None,
                f"block_scaled_dot RHS is {rhs.element}; it must be U32 like the LHS "
                "(QuantizeMX's packed data)",
                "pass QuantizeMX's quantized_data (u32) as the rhs",
            )  # fmt: skip
        )
    if config is None or lhs is None or rhs is None or len(lhs.dims) < 2 or len(rhs.dims) < 2:
        return out
    return out + _dims_rules(config, lhs, rhs)


def _dims_rules(config: dict[str, Any], lhs: ArrayType, rhs: ArrayType) -> list[Problem]:
    out: list[Problem] = []
    element = config["element_dtype"]
    if element and element not in FP8_NAMES:
        out.append(
            (
                None,
                f"block_scaled_dot element_dtype {element!r}: QuantizeMX makes "
                "float8_e5m2 or float8_e4m3fn",
                "set element_dtype to the QuantizeMX dtype",
            )  # fmt: skip
        )
    contracting = {}
    for side, array in (("lhs", lhs), ("rhs", rhs)):
        rank = len(array.dims)
        batch = config[f"{side}_batch_dimensions"]
        bad = [d for d in batch if not 0 <= d < rank]
        if bad:
            out.append(
                (
                    "EVRF054",
                    f"block_scaled_dot {side} batch dims {bad} outside [0, {rank})",
                    "use batch dims with 0 <= dim < rank",
                )  # fmt: skip
            )
        given = config[f"{side}_contracting_dimensions"]
        c = given[0] if given else rank - 1
        if not 0 <= c < rank:
            out.append(
                (
                    "EVRF055",
                    f"block_scaled_dot {side} contracting dim {c} outside [0, {rank})",
                    "use a contracting dim with 0 <= dim < rank",
                )  # fmt: skip
            )
            continue
        contracting[side] = c
        if c in batch:
            out.append(
                (
                    "EVRF053",
                    f"block_scaled_dot {side} contracting dim {c} is also a batch dim {batch}",
                    "make batch and contracting dims disjoint",
                )  # fmt: skip
            )
    if len(contracting) == 2:
        k_l, k_r = lhs.dims[contracting["lhs"]], rhs.dims[contracting["rhs"]]
        if k_l != k_r:
            out.append(
                (
                    "EVRF050",
                    f"block_scaled_dot contracting dims differ: lhs dim "
                    f"{contracting['lhs']} = {k_l}, rhs dim {contracting['rhs']} = {k_r}",
                    "contract dims of the same size",
                )  # fmt: skip
            )
    lb, rb = config["lhs_batch_dimensions"], config["rhs_batch_dimensions"]
    if (
        len(lb) == len(rb)
        and all(0 <= d < len(lhs.dims) for d in lb)
        and all(0 <= d < len(rhs.dims) for d in rb)
    ):
        pl, pr = math.prod(lhs.dims[d] for d in lb), math.prod(rhs.dims[d] for d in rb)
        if pl != pr:
            out.append(
                (
                    "EVRF048",
                    f"block_scaled_dot batch sizes differ: lhs {pl}, rhs {pr} "
                    f"(product over dims {lb} and {rb})",
                    "batch dims of equal total size",
                )  # fmt: skip
            )
    return out


# ---------------------------------------------------------------------- the assumed layout

_FROM = "assumed layout (undocumented): "


def _layout(
    ins: Instruction, by_name: dict[str, Instruction], operands: list[ArrayType | None]
) -> list[tuple[str, str]]:
    """(what, fix) warnings where a call departs from the layout mx_calls.py assumes."""
    if ins.custom_call_target == QUANTIZE_MX:
        x, config = operands[0] if operands else None, _config(ins)[1]
        dim = config.get("dim", 0) if isinstance(config, dict) else None
        d = _quantize_dim(x, dim) if x is not None else None
        if d is None or not ins.is_tuple or len(ins.leaves) != 2:
            return []
        scales = ins.leaves[1]
        want = tuple(-(-n // _BLOCK) if k == d else n for k, n in enumerate(x.dims))  # type: ignore[union-attr]
        if scales.element == "u8" and scales.dims == want:
            return []
        return [(f"{_FROM}QuantizeMX scales {scales}, expected u8{list(want)}",
                 "declare the scales u8 with the quantized dim / 32")]  # fmt: skip
    if len(ins.operands) != 4:  # EVRF043 says it
        return []
    out, producers = [], []
    roles = ("lhs", "rhs", "lhs_scale", "rhs_scale")
    for k, (name, index) in enumerate(zip(ins.operands, (0, 0, 1, 1), strict=True)):
        source = by_name.get(name)
        producer = by_name.get(source.operands[0]) if source and source.operands else None
        producers.append(producer.name if producer is not None else None)
        part = "data" if index == 0 else "scales"
        if (
            source is None
            or source.opcode != "get-tuple-element"
            or source.attrs.get("index") != str(index)
            or producer is None
            or producer.custom_call_target != QUANTIZE_MX
        ):
            out.append((f"{_FROM}block_scaled_dot {roles[k]} ({name}) is not QuantizeMX's "
                        f"{part} output", "feed the dot QuantizeMX's outputs directly"))  # fmt: skip
        elif k >= 2 and producers[k] != producers[k - 2]:
            out.append((f"{_FROM}block_scaled_dot {roles[k]} ({name}) is the scales of "
                        f"{producers[k]}, its data of {producers[k - 2]}",
                        f"pass the scales of the QuantizeMX that made the {roles[k - 2]}"))  # fmt: skip
    return out
