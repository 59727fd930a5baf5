"""Convert a decomposed `torch.export.ExportedProgram` into a portable `Program`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import (
    ConstantArgument,
    TensorArgument,
)
from torch.export.graph_signature import (
    InputKind as EInputKind,
)
from torch.export.graph_signature import (
    OutputKind as EOutputKind,
)
from torch.export.graph_signature import (
    OutputSpec as EOutputSpec,
)

from ..errors import CaptureError
from ..ir.program import Program, ProgramKind, has_no_data
from ..ir.signature import InputKind, InputSpec, OutputKind, OutputSpec, Signature, TensorSpec
from ..ir.source import from_fx_meta
from ..opset import OPSET_VERSION
from .abstract import abstract_weight
from .diagnose import is_user_file

_INPUT_KINDS = {
    EInputKind.PARAMETER: InputKind.PARAMETER,
    EInputKind.BUFFER: InputKind.BUFFER,
    EInputKind.CONSTANT_TENSOR: InputKind.CONSTANT,
    EInputKind.USER_INPUT: InputKind.USER_INPUT,
}


def tensor_meta(value: Any) -> TensorSpec | tuple | None:
    """TensorSpec(s) from a node's `val` (a FakeTensor or a tuple of them)."""
    if isinstance(value, torch.Tensor):
        return TensorSpec.of(value)
    if isinstance(value, (tuple, list)):
        return tuple(tensor_meta(v) for v in value)
    return None


def annotate(gm: torch.fx.GraphModule, strip_prefix: str = "") -> None:
    """Set `meta["tensor"]` and `meta["source"]` on every node from torch.export's metadata."""
    for node in gm.graph.nodes:
        if "val" in node.meta and "tensor" not in node.meta:
            node.meta["tensor"] = tensor_meta(node.meta["val"])
        if node.op == "call_function" and "source" not in node.meta:
            node.meta["source"] = from_fx_meta(node.meta, is_user_file, strip_prefix)


def output_names(ep: torch.export.ExportedProgram, count: int) -> list[str]:
    """Readable names for the user outputs from the output pytree ("logits", "0", "aux.loss")."""
    try:
        tree = pytree.tree_unflatten(list(range(count)), ep.call_spec.out_spec)
        leaves, _ = pytree.tree_flatten_with_path(tree)
        names = [
            pytree.keystr(path).strip("[]").replace("][", ".").replace("'", "")
            for path, _ in leaves
        ]
    except Exception:  # an unusual output container: fall back to positions
        names = []
    if len(names) != count or len(set(names)) != count:
        names = [str(i) for i in range(count)]
    return [re.sub(r"[^A-Za-z0-9_.]", "_", n) or str(i) for i, n in enumerate(names)]


def to_program(
    ep: torch.export.ExportedProgram,
    kind: ProgramKind,
    *,
    name: str,
    strip_prefix: str = "",
    options: dict[str, Any] | None = None,
) -> Program:
    """Build the Program (signature, weights, node metadata) from a decomposed export."""
    gm = ep.graph_module
    annotate(gm, strip_prefix)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    state = {**ep.state_dict, **ep.constants}

    def strip(target: str | None) -> str | None:
        if target and strip_prefix and target.startswith(strip_prefix):
            return target[len(strip_prefix) :]
        return target

    inputs, weights = [], {}
    for node, spec in zip(placeholders, ep.graph_signature.input_specs, strict=True):
        if spec.kind not in _INPUT_KINDS:
            raise CaptureError(
                f"input {node.name} of kind {spec.kind.name} is not supported",
                fix="pass tensors only; script objects and tokens cannot be captured",
            )
        target = strip(spec.target)
        if not isinstance(node.meta.get("val"), torch.Tensor):
            raise CaptureError(
                f"input {node.name!r} is not a tensor ({type(node.meta.get('val')).__name__})",
                fix="pass tensors as example inputs; bind other arguments with functools.partial",
            )
        inputs.append(InputSpec(node.name, _INPUT_KINDS[spec.kind], node.meta["tensor"], target))
        if target is not None:
            weights[target] = _snapshot(state[spec.target])

    by_target = {i.target: i.name for i in inputs if i.target}
    out_node = gm.graph.output_node()
    out_args = list(out_node.args[0])
    user_count = sum(
        1 for s in ep.graph_signature.output_specs if s.kind == EOutputKind.USER_OUTPUT
    )
    user_names = iter(output_names(ep, user_count))
    outputs = []
    for arg, spec in zip(out_args, ep.graph_signature.output_specs, strict=True):
        if isinstance(spec.arg, ConstantArgument) or not isinstance(spec.arg, TensorArgument):
            raise CaptureError(
                f"the model returns a non-tensor value ({spec.arg.value!r})"
                if isinstance(spec.arg, ConstantArgument)
                else "the model returns a non-tensor value",
                fix="return tensors only (tuples, lists and dicts of tensors are fine)",
            )
        outputs.append(_output_spec(arg, spec, strip(spec.target), by_target, user_names))
    _refuse_caches(outputs)
    _refuse_input_writes_in_training(kind, outputs)
    metadata = {"name": name, "opset_version": OPSET_VERSION, "capture": options or {}}
    symbols = symbolic_dims(ep, inputs)
    if symbols:
        metadata["symbolic_dims"] = symbols
    return Program(
        kind=kind,
        graph_module=gm,
        signature=Signature(tuple(inputs), tuple(outputs)),
        weights=weights,
        metadata=metadata,
    )


def _snapshot(value: torch.Tensor) -> torch.Tensor:
    """A weight's copy (not the live model's tensor); a tensor without data (an abstract
    capture's fake, a meta buffer) becomes a meta tensor of its shape and dtype."""
    if has_no_data(value):
        return abstract_weight(value)
    return value.detach().clone()


def _bound(value, unbounded):
    """An int from a sympy bound, or `unbounded` for infinities (sympy's or torch's int_oo)."""
    try:
        return int(value)
    except (TypeError, OverflowError, AttributeError):
        return unbounded


def symbolic_dims(ep: torch.export.ExportedProgram, inputs: list[InputSpec]) -> dict[str, dict]:
    """Declared dynamic dims of the inputs: symbol -> {min, max, source ("idx.shape[0]")}.

    Only symbols that size an input count; torch may track others (unbacked values) that no
    tensor shape uses."""
    where: dict[str, str] = {}
    for i in inputs:
        for d, size in enumerate(i.spec.shape):
            if isinstance(size, str):
                where.setdefault(size, f"{i.name}.shape[{d}]")
    out = {}
    for symbol, bounds in ep.range_constraints.items():
        name = str(symbol)
        if name in where:
            out[name] = {
                "min": _bound(bounds.lower, 0),
                "max": _bound(bounds.upper, None),
                "source": where[name],
            }
    return out


def _output_spec(
    arg: torch.fx.Node,
    spec: EOutputSpec,
    target: str | None,
    by_target: dict[str, str],
    user_names: Iterator[str],
) -> OutputSpec:
    meta = arg.meta["tensor"]
    if spec.kind == EOutputKind.USER_OUTPUT:
        return OutputSpec(next(user_names), OutputKind.OUTPUT, meta)
    if spec.kind == EOutputKind.LOSS_OUTPUT:
        return OutputSpec("loss", OutputKind.LOSS, meta)
    if spec.kind == EOutputKind.BUFFER_MUTATION:
        assert target is not None, "torch.export names the buffer a mutation updates"
        return OutputSpec(
            f"{target}.updated", OutputKind.UPDATED_STATE, meta, target, by_target[target]
        )
    if spec.kind == EOutputKind.GRADIENT_TO_PARAMETER:
        return OutputSpec(f"{target}.grad", OutputKind.GRADIENT, meta, target)
    if spec.kind == EOutputKind.USER_INPUT_MUTATION:
        # the new value is an output; the executable writes it into the caller's tensor
        assert target is not None, "torch.export names the input a mutation updates"
        return OutputSpec(f"{target}.updated", OutputKind.UPDATED_INPUT, meta, aliases=target)
    raise CaptureError(f"unsupported output kind {spec.kind.name}", fix="return tensors only")


def _refuse_input_writes_in_training(kind: ProgramKind, outputs: list[OutputSpec]) -> None:
    """An inference program may write into its inputs (the executable copies the new values
    back, as eager does); a training step's batch is read-only."""
    written = [o.aliases for o in outputs if o.kind is OutputKind.UPDATED_INPUT]
    if kind is ProgramKind.TRAINING_STEP and written:
        raise CaptureError(
            f"the training step mutates its input {written[0]!r} in place",
            fix="compute a new tensor instead of writing into an input (x = x + 1, not x += 1), "
            "or keep running statistics in buffers (nn.BatchNorm*), which the step updates",
        )


def _refuse_caches(outputs: list[OutputSpec]) -> None:
    for out in outputs:
        if out.kind == OutputKind.OUTPUT and re.search(r"past_key_values|cache", out.name, re.I):
            raise CaptureError(
                f"the model returns a key/value cache ({out.name})",
                fix="capture without caches: call the model with use_cache=False",
            )
