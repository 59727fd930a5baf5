"""Running an exported model with ONNX Runtime on CPU: torch tensors in, torch tensors out.

Graph optimizations are limited to ORT's basic level (constant folding, redundant-node removal):
the extended and layout levels fuse subgraphs into kernels that round differently (e.g. GELU and
LayerNorm fusions), and the backend is held to the `cpu` reference's rounding. Tensors cross as
`OrtValue`s over numpy arrays; bfloat16, which numpy lacks, crosses as its 16-bit pattern in and
by DLPack out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from portable.errors import BackendError
from portable.ir.program import Program
from portable.ir.signature import InputKind

from .export import ExportedModel

if TYPE_CHECKING:
    from onnxruntime import OrtValue

__all__ = ["session_function"]

_BFLOAT16 = 16  # onnx.TensorProto.BFLOAT16


def session_function(
    exported: ExportedModel, program: Program
) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    """The program's flat inputs -> its user outputs, over one `InferenceSession` of the model's
    files (the model takes the user inputs by name; the weights are its initializers)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    try:
        session = ort.InferenceSession(
            str(exported.path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as error:  # onnxruntime's pybind errors share no base class
        raise _ort_error(
            f"cannot run the model of {program.name}",
            error,
            "a kernel ORT's CPU provider lacks: run the program on `cpu` or `xla`",
        ) from error
    # the model takes the user inputs in the signature's order; by position, not by name: an
    # input the program returns as is may carry the output's name in the model
    users = [i for i, s in enumerate(program.signature.inputs) if s.kind is InputKind.USER_INPUT]
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(users):
        raise BackendError(
            f"the ONNX model of {program.name} takes {len(names)} inputs, the program "
            f"{len(users)} user inputs",
            fix="report it with the program archive; run the program on `cpu` or `xla` meanwhile",
        )

    def run(flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feeds = {name: _to_ort(ort, flat[i]) for name, i in zip(names, users, strict=True)}
        try:
            outputs = session.run_with_ort_values(None, feeds)
        except Exception as error:  # onnxruntime's pybind errors share no base class
            raise _ort_error(
                f"failed running the model of {program.name}",
                error,
                "a kernel ORT's CPU provider lacks for these dtypes, found only at run time: "
                "run the program on `cpu` or `xla`",
            ) from error
        # an output that is one of its inputs (identity programs) is ORT's view of the feed's
        # memory, which the caller's tensor owns: copied, so it outlives that tensor
        fed = {value.data_ptr() for value in feeds.values()}
        return [_to_torch(o).clone() if o.data_ptr() in fed else _to_torch(o) for o in outputs]

    return run


def _ort_error(what: str, error: BaseException, fix: str) -> BackendError:
    """ONNX Runtime's error as a BackendError: `what` went wrong, with ORT's first line."""
    text = str(error).strip()
    return BackendError(
        f"ONNX Runtime (CPU) {what}: {text.splitlines()[0] if text else type(error).__name__}",
        fix=fix,
    )


def _to_ort(ort: ModuleType, value: torch.Tensor) -> OrtValue:
    value = value.detach().cpu().contiguous()
    if value.dtype == torch.bfloat16:
        bits = value.view(torch.int16).numpy()
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, _BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(value.numpy())


def _to_torch(value: OrtValue) -> torch.Tensor:
    if value.data_type() == "tensor(bfloat16)":
        return torch.from_dlpack(value._get_c_value().to_dlpack())
    return torch.from_numpy(value.numpy())
