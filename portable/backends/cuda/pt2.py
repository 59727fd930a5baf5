"""The program as a `torch.export` archive (`.pt2`), written and read without pickle.

The archive holds the export graph (ATen ops + the kernel-backed `portable::` ops) as an
`nn.Module` whose state lives in buffers, so it is self-contained:

- inference: `module(*inputs)` returns the outputs;
- training step: `module(*batch)` runs one step, updates its buffers (parameters and optimizer
  state) in place, and returns the loss.

It loads wherever `portable` is installed (the `portable::` ops must be registered):
`portable.backends.cuda.load_pt2(path)`, which refuses archives with pickled members, then
`torch.export.load`. Buffers are named after the weight keys with `.` -> `__`
(`fc1.weight` -> `fc1__weight`).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import torch

from portable.errors import ArchiveError, LoweringError
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import InputKind, OutputKind, OutputSpec
from portable.ir.source import source_of
from portable.torch_compat import quiet_internal_warnings

from .values import concrete_shape

__all__ = ["ProgramModule", "buffer_name", "export_program", "load_pt2", "save_pt2"]


def buffer_name(weight_key: str) -> str:
    return weight_key.replace(".", "__")


class ProgramModule(torch.nn.Module):
    """A program's graph with its state as buffers (see the module docstring for the calls)."""

    def __init__(self, program: Program, gm: torch.fx.GraphModule) -> None:
        super().__init__()
        self.graph_module = gm
        self._inputs = program.signature.inputs
        self._outputs = _write_backs(program.signature.outputs)
        self._training = program.kind is ProgramKind.TRAINING_STEP
        for spec in program.signature.state_inputs:
            self.register_buffer(buffer_name(spec.key), program.weights[spec.key].clone())

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        it = iter(inputs)
        flat = [
            next(it) if i.kind is InputKind.USER_INPUT else getattr(self, buffer_name(i.key))
            for i in self._inputs
        ]
        outputs = self.graph_module(*flat)
        results = []
        for (kind, target), value in zip(self._outputs, outputs, strict=True):
            if target is not None:  # an updated value, written back into its buffer
                getattr(self, buffer_name(target)).copy_(value)
            elif kind in (OutputKind.LOSS, OutputKind.OUTPUT):
                results.append(value)
        return results[0] if len(results) == 1 else tuple(results)


def _write_backs(outputs: tuple[OutputSpec, ...]) -> list[tuple[OutputKind, str | None]]:
    """Per output: its kind, and the weight key an updated value is written back to (else None)."""
    updates = (OutputKind.UPDATED_PARAMETER, OutputKind.UPDATED_STATE)
    return [(o.kind, o.key if o.kind in updates else None) for o in outputs]


def _example_inputs(program: Program) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Inputs of the signature's shapes (dynamic dims at their planning size, `values.py`) and
    the `dynamic_shapes` that declare those dims again."""
    symbols = program.metadata.get("symbolic_dims", {})
    dims = {
        name: torch.export.Dim(name.replace("-", "_"), min=b["min"], max=b["max"] or 2**31 - 2)
        for name, b in symbols.items()
    }
    examples, dynamic = [], []
    for spec in program.signature.user_inputs:
        shape = concrete_shape(spec.spec, symbols)
        decl = {d: dims[size] for d, size in enumerate(spec.spec.shape) if isinstance(size, str)}
        dtype = spec.spec.dtype
        value = (
            torch.zeros(shape, dtype=dtype)
            if not dtype.is_floating_point
            else torch.randn(shape).to(dtype)
        )
        examples.append(value)
        dynamic.append(decl or None)
    # forward(*inputs): the one vararg takes the whole tuple of per-input declarations
    return tuple(examples), ((tuple(dynamic),) if symbols else None)


def export_program(program: Program, gm: torch.fx.GraphModule) -> torch.export.ExportedProgram:
    """`torch.export` of `ProgramModule(program, gm)` (LoweringError if export refuses it)."""
    module = ProgramModule(program, gm)
    inputs, dynamic = _example_inputs(program)
    try:
        with quiet_internal_warnings():
            ep = torch.export.export(module, inputs, dynamic_shapes=dynamic, strict=False)
    except Exception as exc:  # torch raises many types here; the message is what helps
        raise LoweringError(
            f"torch.export could not export {program.name} for the .pt2: {exc}",
            backend="cuda",
            fix="nothing was written for this target: report this with the program archive; "
            "the other targets lower without it (drop `-t cuda`)",
        ) from exc
    _user_stack_traces(ep, gm)
    return ep


def _user_stack_traces(ep: torch.export.ExportedProgram, gm: torch.fx.GraphModule) -> None:
    """Each exported node's `stack_trace` is the user's line of the node of `gm` it was traced
    from (by name), or none: torch.export records the frames of its own trace (portable's
    module at its install path, torch.fx's generated code), which tell a reader nothing and
    made the .pt2 depend on where portable is installed."""
    traces = {
        n.name: trace
        for n in gm.graph.nodes
        if (loc := source_of(n)) is not None and (trace := loc.stack_trace()) is not None
    }
    for node in ep.graph.nodes:
        trace = traces.get(node.name)
        if trace is None:
            node.meta.pop("stack_trace", None)
        else:
            node.meta["stack_trace"] = trace


def save_pt2(ep: torch.export.ExportedProgram, path: Path) -> Path:
    """Write `ep` to `path` without example inputs: torch pickles them otherwise (with none,
    their member is empty), and no tensor is pickled (checked after writing)."""
    ep = torch.export.ExportedProgram(
        root=ep.graph_module,
        graph=ep.graph,
        graph_signature=ep.graph_signature,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        example_inputs=None,
        constants=ep.constants,
        verifiers=[ep.verifier],
    )
    with quiet_internal_warnings():
        torch.export.save(ep, path)
    _check_no_pickle(path)
    return path


def _check_no_pickle(path: Path) -> None:
    """ArchiveError if the archive has a member torch would unpickle on load."""
    try:
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                name = info.filename
                pickled = name.endswith((".pt", ".pkl", ".pickle")) or "/sample_inputs/" in name
                if pickled and info.file_size > 0:
                    raise ArchiveError(
                        f"{path}: member {name} is a pickle",
                        fix="portable never loads pickles from artifacts; re-export the .pt2 "
                        "with `portable lower`",
                    )
                if name.endswith("_config.json"):
                    config = json.loads(z.read(info))
                    for entry in config.get("config", {}).values():
                        if isinstance(entry, dict) and entry.get("use_pickle"):
                            raise ArchiveError(
                                f"{path}: {name} stores a tensor as a pickle",
                                fix="re-export the .pt2 with `portable lower`",
                            )
    except zipfile.BadZipFile as exc:
        raise ArchiveError(
            f"{path} is not a .pt2 archive: {exc}", fix="re-run portable lower"
        ) from exc


def load_pt2(path: str | Path) -> torch.export.ExportedProgram:
    """Load a `.pt2` written by the cuda backend; its `portable::` ops run on CPU through
    portable's kernels and on CUDA through the Triton kernels (registered here)."""
    from . import ops  # noqa: F401 (registers the CUDA kernels of the portable ops)

    path = Path(path)
    if not path.is_file():
        raise ArchiveError(
            f"no .pt2 at {path}", fix="pass the program.pt2 that portable lower wrote"
        )
    _check_no_pickle(path)
    with quiet_internal_warnings():
        return torch.export.load(path)
