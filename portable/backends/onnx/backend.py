"""`onnx`: inference programs exported to ONNX (export.py) and run by ONNX Runtime on CPU.

lower -> `model.onnx` (+ `model.onnx.data` for weights over 2 GB) checked by onnx.checker, and
its readable text; compile -> the files under out_dir and an `InferenceSession`; executable ->
the portable Executable (torch tensors in and out through numpy). Training steps and per-rank
programs are refused with what to export instead. onnx, onnxruntime and onnxscript are imported
only here, inside the methods.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from torch.fx import Node

from portable.errors import BackendError, LoweringError
from portable.ir.program import Program, ProgramKind
from portable.ir.source import source_of
from portable.opset import bind, lookup, op_name, opset_table
from portable.runtime import Executable

from ..base import INTEGER_DTYPES, Backend, Capabilities, Lowered, Target, Written
from .unsupported import UNSUPPORTED

if TYPE_CHECKING:
    import torch

__all__ = ["OnnxBackend"]

# Ops an inference program may not hold here: backward ops belong to training steps, which this
# backend refuses (the exporter has no rules for them).
_TRAINING_ONLY = frozenset(
    {
        "portable.attention_backward.default",
        "portable.attention_backward.mask_grad",
        "portable.rms_norm_backward.default",
        "aten._native_batch_norm_legit_functional.default",
    }
)
_COLLECTIVES = frozenset(
    f"portable.{name}.default"
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "local_shard")
)


# ONNX Runtime's CPU provider has no float64 kernel for these ONNX ops (Asin, ..., Erf,
# LeakyRelu): the session would fail at run time, so check_program refuses them first
_NO_FLOAT64 = "ONNX Runtime's CPU provider has no float64 kernel for it"
_DTYPE_GAPS = {
    f"aten.{name}": {"float64": _NO_FLOAT64}
    for name in (
        "asin.default",
        "acos.default",
        "atan.default",
        "atan2.default",
        "sinh.default",
        "cosh.default",
        "tan.default",
        "asinh.default",
        "acosh.default",
        "atanh.default",
        "erf.default",
        "erfinv.default",
        "leaky_relu.default",
    )
}


# ONNX Runtime's Conv / ConvTranspose and AveragePool have float kernels only, its MaxPool float
# and 8-bit ones
for _name, _kernel, _dtypes in (
    ("aten.convolution.default", "Conv", INTEGER_DTYPES),
    ("aten.avg_pool2d.default", "AveragePool", INTEGER_DTYPES),
    ("aten.avg_pool3d.default", "AveragePool", INTEGER_DTYPES),
    ("aten.max_pool2d_with_indices.default", "MaxPool", ("int64", "int32", "int16")),
):
    _DTYPE_GAPS[_name] = {
        d: f"ONNX Runtime's CPU provider has no {d} {_kernel} kernel" for d in _dtypes
    }

# ops torch computes in the half type itself, step by step, where ONNX Runtime (and the
# bfloat16 rewrite) compute float32 and round once (translations/spatial.py)
for _name, _why in {
    "aten.grid_sampler_2d.default": "torch samples a half-precision grid in that type",
    "aten.addmv.default": "torch applies beta and alpha rounded to the half type",
    "aten.addbmm.default": "torch rounds addbmm after each batch in the half type",
}.items():
    _DTYPE_GAPS[_name] = {
        h: f"{_why}; ONNX Runtime computes float32" for h in ("bfloat16", "float16")
    }


class OnnxBackend(Backend):
    name = "onnx"

    def capabilities(self) -> Capabilities:
        ops = frozenset(
            name
            for name in opset_table()
            if name not in _TRAINING_ONLY
            and name not in UNSUPPORTED
            and not name.endswith("_backward.default")
            and not name.endswith("_backward_data.default")
        )
        return Capabilities(
            ops=ops,
            dtype_gaps=_DTYPE_GAPS,
            program_kinds=frozenset({ProgramKind.INFERENCE}),
            requires=("onnx", "onnxruntime", "onnxscript"),
        )

    def lower(self, program: Program, target: Target) -> Lowered:
        _refuse_unexportable(program)
        program.require_values("lowering to onnx (model.onnx holds the weights)")
        self.check_program(program, target)  # BackendError when onnx packages are missing
        _check_nodes(program)
        from .export import MODEL_FILE, export_program, model_text

        exported = export_program(program)
        texts = {MODEL_FILE + ".txt": model_text(exported.path)}
        return Lowered(program, target, texts=texts, payload=exported)

    def write(self, lowered: Lowered, out_dir: Path | None = None) -> Written:
        files = []
        if out_dir is not None:
            for source in lowered.payload.files():
                shutil.copyfile(source, out_dir / source.name)
                files.append(out_dir / source.name)
            for name, text in lowered.texts.items():
                path = out_dir / name
                path.write_text(text)
                files.append(path)
        return Written(lowered, files, payload=lowered.payload)

    def executable(self, compiled: Written) -> Executable:
        self.require()
        from .session import session_function

        return Executable(
            compiled.lowered.program,
            session_function(compiled.payload, compiled.lowered.program),
            self.name,
        )


def _refuse_unexportable(program: Program) -> None:
    """Training steps: say what to export instead (per-rank programs are refused by
    `check_program`: onnx does not declare `per_rank`)."""
    if program.kind is ProgramKind.TRAINING_STEP:
        raise BackendError(
            f"backend onnx exports inference programs; {program.name} is a training step",
            fix="export the forward program: portable.capture(model, example_inputs) without "
            "loss_fn/optimizer, or `portable lower SPEC -t onnx` without --train",
        )


def _check_nodes(program: Program) -> None:
    """Refuse, at the user's line, what export would fail on or get wrong: complex results (the
    exporter keeps only the real part), avg_pool2d's divisor_override (ignored by AveragePool), a
    collective over more than one rank (one rank: the identity) and MX arguments the MX rules do
    not take."""
    from .translations.mx import check_node

    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if any(d is not None and d.is_complex for d in _result_dtypes(node)):
            raise _located(
                node,
                f"backend onnx has no complex tensors: {op_name(node.target)} makes one (torch.onnx "
                "would export its real part only)",
                "keep complex values as real pairs: torch.view_as_real(z) before the op, or "
                "run the program on `cpu`",
            )
        if (
            op_name(node.target) == "aten.avg_pool2d.default"
            and _divisor_override(node) is not None
        ):
            raise _located(
                node,
                "backend onnx cannot export aten.avg_pool2d.default with divisor_override "
                "(ONNX AveragePool always divides by the window size)",
                "drop divisor_override and rescale: F.avg_pool2d(x, k) * (kh * kw / divisor), "
                "or run the program on `cpu` or `xla`",
            )
        if lookup(node.target) is None:
            continue
        name = op_name(node.target)
        if name in _COLLECTIVES and (group := bind(node).literal("group_size")) != 1:
            raise _located(
                node,
                f"backend onnx has no rule for {name} over a group of {group} ranks",
                "export the global program (before `spmd-partition`); collectives of one rank "
                "export as Identity",
            )
        if _static(node):  # symbolic dims are checked by the MX rules while exporting
            check_node(node)  # LoweringError at the node


def _result_dtypes(node: Node) -> list[torch.dtype | None]:
    """The dtypes of `node`'s results (its TensorSpec metadata, which archives store too; none
    where it has no metadata)."""
    value = node.meta.get("tensor")
    values = value if isinstance(value, (tuple, list)) else [value]
    return [getattr(v, "dtype", None) for v in values]


def _divisor_override(node: Node) -> object:
    if "divisor_override" in node.kwargs:
        return node.kwargs["divisor_override"]
    return node.args[6] if len(node.args) > 6 else None


def _static(node: Node) -> bool:
    """Whether every tensor argument of `node` has a static shape."""
    shapes = [getattr(a.meta.get("tensor"), "shape", None) for a in node.all_input_nodes]
    return all(s is not None and all(isinstance(d, int) for d in s) for s in shapes)


def _located(node: Node, what: str, fix: str | None) -> LoweringError:
    src = source_of(node)
    return LoweringError(
        what,
        backend="onnx",
        op=op_name(node.target),
        module=src.module if src else None,
        source=src.location() if src else None,
        fix=fix,
    )
