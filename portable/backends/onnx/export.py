"""Program -> ONNX model, through `torch.onnx.export(dynamo=True)`.

The exported module holds the program's weights as buffers (they become the model's
initializers) and takes the user inputs; it calls the program's graph, so ATen ops go through
torch.onnx's own translations and portable ops through `translations/`. Dims the program declares
dynamic (metadata["symbolic_dims"], symbols in the signature's shapes) are exported as named
dynamic ONNX dims. The model is written into a directory (`model.onnx`, and `model.onnx.data`
when the weights exceed EXTERNAL_DATA_THRESHOLD) and checked there by
`onnx.checker.check_model(path, full_check=True)`, which also works past protobuf's 2 GB.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import torch

from portable.errors import BackendError
from portable.ir.program import Program
from portable.ir.signature import InputKind, OutputKind, TensorSpec
from portable.ir.source import source_of
from portable.torch_compat import copy_graph_module, quiet_onnx_registry

from .bfloat16 import compute_in_float32

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "MODEL_FILE",
    "OPSET",
    "ExportedModel",
    "export_program",
    "model_text",
]

# ONNX opset 23 is the first with `Attention` and `RMSNormalization`, and the Float4E2M1 type of
# MX FP4; ONNX Runtime 1.32 runs all three on its CPU execution provider.
OPSET = 23
# Weights over 2 GB cannot live inside one protobuf: they go to `model.onnx.data` beside it.
EXTERNAL_DATA_THRESHOLD = 2 * 1024**3
MODEL_FILE = "model.onnx"
DATA_FILE = MODEL_FILE + ".data"


@dataclasses.dataclass
class ExportedModel:
    """The model files in a private temporary directory (removed with this object)."""

    directory: tempfile.TemporaryDirectory
    external_data: bool
    dim_names: dict[str, str]  # program symbol -> ONNX dim name

    @property
    def path(self) -> Path:
        return Path(self.directory.name) / MODEL_FILE

    def files(self) -> list[Path]:
        names = [MODEL_FILE, DATA_FILE] if self.external_data else [MODEL_FILE]
        return [Path(self.directory.name) / n for n in names]


class _ProgramModule(torch.nn.Module):
    """The program as a module: weights as buffers, user inputs as arguments, user outputs."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.graph_module = copy_graph_module(program.graph_module)
        self._inputs = [
            (s.kind is InputKind.USER_INPUT, _buffer_name(s.target))
            for s in program.signature.inputs
        ]
        for spec in program.signature.state_inputs:
            name = _buffer_name(spec.key)
            if not hasattr(self, name):
                self.register_buffer(name, program.weights[spec.key])
        self._outputs = [
            i for i, o in enumerate(program.signature.outputs) if o.kind is OutputKind.OUTPUT
        ]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        users = iter(inputs)
        flat = [next(users) if user else getattr(self, name) for user, name in self._inputs]
        outputs = self.graph_module(*flat)
        results: list[torch.Tensor] = []
        for i in self._outputs:
            out = outputs[i]
            # an output that is an input, a weight or an earlier output gets its own ONNX value
            # (else the graph's output names the input and the session cannot feed it)
            if any(out is t for t in (*flat, *results)):
                out = out.clone()
            results.append(out)
        return tuple(results)


def _buffer_name(target: str | None) -> str:
    return "" if target is None else "w_" + re.sub(r"[^A-Za-z0-9_]", "_", target)


def export_program(
    program: Program, *, external_data_threshold: int | None = None
) -> ExportedModel:
    """Export an inference program (the backend checks kind and ops first); BackendError naming
    the cause when torch.onnx cannot export it or the checker refuses the model."""
    import onnx

    from .translations import translation_table

    threshold = (
        EXTERNAL_DATA_THRESHOLD if external_data_threshold is None else external_data_threshold
    )
    module = _ProgramModule(program).eval()
    users = program.signature.user_inputs
    examples, dynamic_shapes, dim_names = _examples(program)
    outputs = [o.name for o in program.signature.outputs if o.kind is OutputKind.OUTPUT]
    log = io.StringIO()
    try:
        with redirect_stdout(log), redirect_stderr(log), quiet_onnx_registry():
            onnx_program = torch.onnx.export(
                module,
                examples,
                dynamo=True,
                opset_version=OPSET,
                custom_translation_table=translation_table(),
                input_names=[u.name for u in users],
                output_names=outputs,
                dynamic_shapes=dynamic_shapes,
                optimize=False,  # see _simplify
                verbose=False,
                report=False,
            )
        assert onnx_program is not None  # None only without dynamo
        _simplify(onnx_program)
    except Exception as error:  # torch.onnx reports export failures with several types
        raise BackendError(
            f"torch.onnx.export failed for {program.name}: {_export_summary(error)}",
            fix="check the op named above against docs/backends/onnx.md's limits; run the "
            "program on `cpu` or `xla` meanwhile",
        ) from error
    weight_bytes = sum(t.numel() * t.element_size() for t in program.weights.values())
    external = weight_bytes > threshold
    directory = tempfile.TemporaryDirectory(prefix="portable-onnx-")
    exported = ExportedModel(directory, external, dim_names)
    onnx_program.save(exported.path, external_data=external)
    _annotate(exported.path, program)
    try:
        onnx.checker.check_model(str(exported.path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as error:
        raise BackendError(
            f"the ONNX model of {program.name} fails onnx.checker (full check): "
            f"{_first_line(error)}",
            fix="report it with the program archive; run the program on `cpu` or `xla` meanwhile",
        ) from error
    return exported


def _simplify(onnx_program: torch.onnx.ONNXProgram) -> None:
    """Fold the model's constants and drop its dead nodes, nothing else. torch.onnx's own
    `optimize` also runs onnxscript's pattern rewriter and fusions: they may change the rounding
    (fused normalizations) and take minutes on the thousands of nodes of an MX-quantized model."""
    from onnxscript import optimizer

    optimizer.fold_constants(onnx_program.model)
    optimizer.remove_unused_nodes(onnx_program.model)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _export_summary(error: BaseException) -> str:
    """The cause in torch.onnx's report (its `## Exception summary`), else the first line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    _, found, rest = text.partition("## Exception summary")
    lines = [line.strip() for line in rest.splitlines() if line.strip()]
    return lines[0] if found and lines else _first_line(error)


def _examples(program: Program) -> tuple[tuple[torch.Tensor, ...], Any, dict[str, str]]:
    """Example user inputs for tracing, the export's dynamic_shapes (None when every dim is
    static) and the ONNX name of each symbolic dim (`<input>_dim<i>` of its first use).

    Each symbol gets its own trace size within its declared range, so no two dynamic dims are
    equal while tracing (torch.export would otherwise take them for one)."""
    from torch.export import Dim

    symbols = program.metadata.get("symbolic_dims", {})
    dims: dict[str, Any] = {}
    sizes: dict[str, int] = {}
    names: dict[str, str] = {}
    examples, shapes = [], []
    generator = torch.Generator().manual_seed(0)
    for user in program.signature.user_inputs:
        spec_dims: dict[int, Any] = {}
        shape = []
        for i, d in enumerate(user.spec.shape):
            if isinstance(d, int):
                shape.append(d)
                continue
            if d not in dims:
                bounds = symbols.get(d, {})
                low, high = int(bounds.get("min", 2) or 2), bounds.get("max")
                names[d] = f"{user.name}_dim{i}"
                dims[d] = Dim(names[d], min=low, max=high)
                size = max(low, 2) + len(sizes)
                sizes[d] = min(size, int(high)) if high is not None else size
            spec_dims[i] = dims[d]
            shape.append(sizes[d])
        shapes.append(spec_dims or None)
        examples.append(_example(TensorSpec(tuple(shape), user.spec.dtype), generator))
    # forward(*inputs) takes one varargs argument: its dynamic shapes nest one level down
    return tuple(examples), ((tuple(shapes),) if dims else None), names


def _example(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    shape = tuple(int(d) for d in spec.shape)
    if spec.dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(spec.dtype)
    if spec.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.zeros(shape, dtype=spec.dtype)  # indices stay in range


def _annotate(path: Path, program: Program) -> None:
    """Name the model after the program and record where it came from (weights untouched)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    model.producer_name = "portable"
    model.graph.name = program.name
    _user_stack_traces(model, program)
    _cast_outputs(model, program)
    compute_in_float32(model, rounded=_op_results(model, program))
    identity = program.identity()
    for key, value in {
        "portable.program": identity["name"],
        "portable.content_hash": identity["content_hash"],
        "portable.opset_version": program.opset_version,
    }.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))


def _cast_outputs(model: Any, program: Program) -> None:
    """Give each graph output the dtype the program declares. torch.onnx computes some bfloat16
    / float16 ops in float32 (its type-promotion pass casts the inputs up and leaves the result
    there): a final `Cast` to the declared dtype makes the result what the `cpu` kernel returns
    (the kernels compute in float32 and round once, as this does)."""
    from onnx import helper

    declared = [o.spec.dtype for o in program.signature.outputs if o.kind is OutputKind.OUTPUT]
    for output, dtype in zip(model.graph.output, declared, strict=False):
        want = _ONNX_TYPE.get(dtype)
        have = output.type.tensor_type.elem_type
        if want is None or have == want:
            continue
        inner = output.name + "__uncast"
        for node in model.graph.node:
            node.output[:] = [inner if o == output.name else o for o in node.output]
            node.input[:] = [inner if i == output.name else i for i in node.input]
        model.graph.node.append(
            helper.make_node("Cast", [inner], [output.name], to=want, name=inner + "_cast")
        )
        output.type.tensor_type.elem_type = want


_ONNX_TYPE = {  # torch dtype -> onnx.TensorProto data type
    torch.float32: 1,
    torch.uint8: 2,
    torch.int8: 3,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.bool: 9,
    torch.float16: 10,
    torch.float64: 11,
    torch.bfloat16: 16,
}
_STACK_TRACE = "pkg.torch.onnx.stack_trace"
_FX_NODE = re.compile(r"%([A-Za-z0-9_]+) :")


def _fx_origin(node: Any) -> str | None:
    """The name of the program node an ONNX node was translated from (torch.onnx's metadata)."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.fx_node":
            match = _FX_NODE.match(prop.value)
            return match.group(1) if match else None
    return None


def _op_results(model: Any, program: Program) -> set[str]:
    """The ONNX values that are results of program ops: those named after a program node, and
    those a node of another program node (or the graph's output) reads: where torch rounds."""
    results = {node.name for node in program.graph.nodes}
    origin = {o: _fx_origin(n) for n in model.graph.node for o in n.output}
    for node in model.graph.node:
        here = _fx_origin(node)
        results.update(i for i in node.input if i in origin and origin[i] != here)
    return results


def _user_stack_traces(model: Any, program: Program) -> None:
    """Each node's `pkg.torch.onnx.stack_trace` becomes the user's line of the program node it
    came from; torch.onnx records the frames of its own trace (portable's exporter at its
    install path, torch.fx's generated code), which tell a reader nothing and made the bytes
    depend on where portable is installed. A node without a user line keeps no trace."""
    sources = {
        n.name: trace
        for n in program.graph.nodes
        if (loc := source_of(n)) is not None and (trace := loc.stack_trace()) is not None
    }
    nodes = [*model.graph.node, *(n for f in model.functions for n in f.node)]
    for node in nodes:
        props = {p.key: p for p in node.metadata_props}
        if _STACK_TRACE not in props:
            continue
        fx_node = props.get("pkg.torch.onnx.fx_node")
        match = _FX_NODE.match(fx_node.value) if fx_node is not None else None
        trace = sources.get(match.group(1)) if match else None
        if trace is None:
            node.metadata_props.remove(props[_STACK_TRACE])
        else:
            props[_STACK_TRACE].value = trace


def model_text(path: Path) -> str:
    """A readable form of the model: its initializers (name, type, shape) and the graph in ONNX's
    textual syntax without the weight values."""
    import onnx
    import onnx.printer

    model = onnx.load(str(path), load_external_data=False)
    lines = [
        f"# {i.name}: {onnx.TensorProto.DataType.Name(i.data_type).lower()}{list(i.dims)}"
        for i in model.graph.initializer
    ]
    del model.graph.initializer[:]
    return "# initializers\n" + "\n".join(lines) + "\n" + onnx.printer.to_text(model) + "\n"
