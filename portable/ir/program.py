"""`Program`: the unit that passes rewrite, backends lower and archives store.

A program is a torch.fx graph over the portable opset plus its signature, weights, plan,
metadata and, for a per-rank program, its layout (`spmd`, a `SpmdLayout`: portable/ir/spmd.py).
Graph placeholders appear in signature-input order; the graph returns one flat tuple in
signature-output order. Two kinds exist:

- `inference`: parameters, buffers and user inputs in; model outputs out.
- `training_step`: parameters, buffers, optimizer state and the batch in; the loss, updated
  parameters, updated optimizer state and updated buffers out (each aliasing its input).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import AbstractProgramError, RegistryError
from ..opset import OPSET_VERSION
from ..torch_compat import copy_graph_lazily, copy_graph_module
from .plan import Plan
from .printer import format_program
from .signature import InputKind, Signature
from .spmd import SpmdLayout

__all__ = [
    "MATERIALIZE_FIX",
    "Persistence",
    "Program",
    "ProgramKind",
    "has_no_data",
    "register_persistence",
]

MATERIALIZE_FIX = (
    "materialize the weights and capture again: model.to_empty(device='cpu') then "
    "model.load_state_dict(...) (a state dict from torch.load or "
    "safetensors.torch.load_file), or build the model on the CPU"
)


def has_no_data(value: torch.Tensor) -> bool:
    """Whether `value` has no data: a meta tensor (an abstract program's weight) or a fake."""
    return value.is_meta or isinstance(value, FakeTensor)


class ProgramKind(enum.StrEnum):
    INFERENCE = "inference"
    TRAINING_STEP = "training_step"


@dataclasses.dataclass
class Program:
    kind: ProgramKind
    graph_module: torch.fx.GraphModule
    signature: Signature
    weights: dict[str, torch.Tensor]
    plan: Plan = dataclasses.field(default_factory=Plan)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the per-rank contract (spmd-partition's output); None for a program that is not per-rank
    spmd: SpmdLayout | None = None

    @property
    def is_per_rank(self) -> bool:
        """Whether this is a per-rank program over more than one rank (`SpmdLayout.is_per_rank`)."""
        return self.spmd is not None and self.spmd.is_per_rank

    @property
    def abstract(self) -> bool:
        """Whether some weight (parameter, buffer, constant, optimizer state) has a shape and a
        dtype but no data: a program captured from a `meta`-device model
        (docs/abstract-capture.md). Passes run on it; running or saving its weights cannot."""
        return any(has_no_data(w) for w in self.weights.values())

    def require_values(self, what: str) -> None:
        """AbstractProgramError if the program is abstract: `what` ("running on cpu",
        "saving the weights") needs weight values."""
        missing = [k for k, w in self.weights.items() if has_no_data(w)]
        if not missing:
            return
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise AbstractProgramError(
            f"{what} needs weight values, but program `{self.name}` is abstract: "
            f"{len(missing)} weights have a shape and a dtype only ({', '.join(missing[:3])}{more})",
            fix=MATERIALIZE_FIX,
        )

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", "program"))

    @property
    def opset_version(self) -> str:
        return str(self.metadata.get("opset_version", OPSET_VERSION))

    @property
    def content_hash(self) -> str:
        """sha256 over the canonical graph, signature, plan and weight bytes (computed by the
        registered `Persistence`: `portable.ir.content_hash.program_hash`)."""
        return _registered().content_hash(self)

    def identity(self) -> dict[str, str]:
        """name, kind and content hash: how manifests name the program they were made from."""
        return {"name": self.name, "kind": self.kind.value, "content_hash": self.content_hash}

    def state(self) -> dict[str, torch.Tensor]:
        """Weights keyed by input placeholder name, in signature order."""
        return {i.name: self.weights[i.key] for i in self.signature.state_inputs}

    def tensor_shapes(self) -> dict[str, tuple[int | str, ...]]:
        """Every input tensor's shape by the name plans use (weight key or input name); a tied
        weight answers to each of its names."""
        shapes = {i.target or i.name: i.spec.shape for i in self.signature.inputs}
        for dropped, kept in self.metadata.get("tied_weights", {}).items():
            if kept in shapes:
                shapes.setdefault(dropped, shapes[kept])
        return shapes

    def parameters(self) -> dict[str, torch.Tensor]:
        return {i.key: self.weights[i.key] for i in self.signature.inputs_of(InputKind.PARAMETER)}

    def replace(self, **changes: Any) -> Program:
        """A copy with some fields changed (graphs are deep-copied, weights shared). An abstract
        program's copy generates its Python code only when printed (it never runs)."""
        copy_graph = copy_graph_lazily if self.abstract else copy_graph_module
        copied = dataclasses.replace(
            self,
            graph_module=copy_graph(self.graph_module),
            weights=dict(self.weights),
            metadata=copy.deepcopy(self.metadata),
        )
        return dataclasses.replace(copied, **changes)

    def save(self, path: str | Path) -> Path:
        """Write the archive (JSON + safetensors) atomically; see docs/archive-format.md.
        The registered `Persistence` writes it (`portable.archive.save`)."""
        return _registered().save(self, path)

    def text(self) -> str:
        """The stable textual form of the graph (for golden tests and `portable inspect`)."""
        return format_program(self)

    def __repr__(self) -> str:
        n = sum(1 for node in self.graph.nodes if node.op == "call_function")
        return (
            f"Program({self.name!r}, kind={self.kind.value}, ops={n}, "
            f"inputs={len(self.signature.inputs)}, outputs={len(self.signature.outputs)})"
        )


# -- persistence: how programs are stored and hashed ------------------------------------------
# The IR does not depend on its storage: `portable.archive` (which owns the archive format and
# uses `portable.ir.serialize` for the JSON and the hash) registers itself here when it is
# imported, and `import portable` imports it. `Program.save` and `Program.content_hash` call
# through this hook.


@dataclasses.dataclass(frozen=True)
class Persistence:
    """How programs are saved and content-hashed (`portable.archive` registers the one there
    is): `save(program, path) -> path written`, `content_hash(program) -> hex sha256`."""

    save: Callable[[Program, str | Path], Path]
    content_hash: Callable[[Program], str]


_PERSISTENCE: list[Persistence] = []  # the registered one (at most one)


def register_persistence(persistence: Persistence) -> None:
    """Install how programs are saved and hashed. Registering the same functions again is a
    no-op (a module imported twice); a different second one is a RegistryError."""
    if _PERSISTENCE and _PERSISTENCE[0] != persistence:
        raise RegistryError(
            "program persistence is registered twice",
            fix="only portable.archive registers it; do not register another",
        )
    _PERSISTENCE[:] = [persistence]


def _registered() -> Persistence:
    if not _PERSISTENCE:
        raise RegistryError(
            "no program persistence is registered (Program.save / content_hash)",
            fix="import portable (it imports portable.archive, which registers it)",
        )
    return _PERSISTENCE[0]
