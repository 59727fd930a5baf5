"""Program signatures: what each graph input and output is.

Inputs are graph placeholders in order; outputs are the graph's output tuple in order. Updated
parameters and state alias the input they replace (`aliases`), which is how backends donate
buffers and how a training loop threads state from one step to the next.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch

from ..errors import VerifyError

__all__ = [
    "InputKind",
    "InputSpec",
    "OutputKind",
    "OutputSpec",
    "Signature",
    "SignatureError",
    "TensorSpec",
]


class SignatureError(VerifyError, ValueError):
    """A signature entry lacks its weight key: a state input, gradient or updated value built
    without `target`, or `key` read where there is none. Also a ValueError, as it always was."""


class InputKind(enum.StrEnum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT = "constant"
    OPTIMIZER_STATE = "optimizer_state"
    USER_INPUT = "user_input"


class OutputKind(enum.StrEnum):
    OUTPUT = "output"
    LOSS = "loss"
    GRADIENT = "gradient"
    UPDATED_PARAMETER = "updated_parameter"
    UPDATED_STATE = "updated_state"
    UPDATED_INPUT = "updated_input"  # a user input's new value (the model writes into it)
    METRIC = "metric"  # a training step's replicated scalar: lr, grad_norm, loss_scale


STATE_INPUTS = (
    InputKind.PARAMETER,
    InputKind.BUFFER,
    InputKind.CONSTANT,
    InputKind.OPTIMIZER_STATE,
)
# output kinds that are about one weight (`OutputSpec.target` is required)
TARGETED_OUTPUTS = (
    OutputKind.GRADIENT,
    OutputKind.UPDATED_PARAMETER,
    OutputKind.UPDATED_STATE,
)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Static shape (ints, or names of declared symbolic dims) and dtype of one tensor."""

    shape: tuple[int | str, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: Any) -> TensorSpec:
        shape = tuple(int(s) if isinstance(s, int) or str(s).isdigit() else str(s) for s in t.shape)
        return TensorSpec(shape, t.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @staticmethod
    def from_json(data: dict[str, Any]) -> TensorSpec:
        return TensorSpec(tuple(data["shape"]), dtype_from_name(data["dtype"]))

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]"


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """`name` is the placeholder; `target` the weight key. Every state input (parameter,
    buffer, constant, optimizer state) has one, checked at construction (`SignatureError`); a
    user input has none. Code that reads state inputs uses `key`, typed as present."""

    name: str
    kind: InputKind
    spec: TensorSpec
    target: str | None = None

    def __post_init__(self) -> None:
        if self.kind in STATE_INPUTS and not isinstance(self.target, str):
            raise SignatureError(
                f"{self.kind.value} input {self.name!r} has no target (weight key)",
                fix="build every state input with target= the weight's key",
            )

    @property
    def key(self) -> str:
        """The weight key of a state input (its `target`); SignatureError for a user input."""
        if self.target is None:
            raise SignatureError(
                f"{self.kind.value} input {self.name!r} has no weight key",
                fix="read `key` of state inputs only (`Signature.state_inputs`)",
            )
        return self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "target": self.target,
            **self.spec.to_json(),
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> InputSpec:
        return InputSpec(d["name"], InputKind(d["kind"]), TensorSpec.from_json(d), d.get("target"))


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    """`target` names what the output is about (the parameter a gradient belongs to): every
    gradient and updated value has one, checked at construction (`SignatureError`), read as `key`;
    `aliases` is the input placeholder an updated value replaces."""

    name: str
    kind: OutputKind
    spec: TensorSpec
    target: str | None = None
    aliases: str | None = None

    def __post_init__(self) -> None:
        if self.kind in TARGETED_OUTPUTS and not isinstance(self.target, str):
            raise SignatureError(
                f"{self.kind.value} output {self.name!r} has no target",
                fix="build every gradient and updated value with target= its weight's key",
            )
        if self.kind is OutputKind.UPDATED_INPUT and not isinstance(self.aliases, str):
            raise SignatureError(
                f"updated_input output {self.name!r} names no input",
                fix="build it with aliases= the user input's placeholder",
            )

    @property
    def key(self) -> str:
        """The weight key a gradient or updated value is about (its `target`); SignatureError
        for an output that is about no weight."""
        if self.target is None:
            raise SignatureError(
                f"{self.kind.value} output {self.name!r} has no target",
                fix=f"read `key` of {', '.join(k.value for k in TARGETED_OUTPUTS)} outputs only",
            )
        return self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind.value,
            "target": self.target,
            "aliases": self.aliases,
            **self.spec.to_json(),
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> OutputSpec:
        return OutputSpec(
            d["name"],
            OutputKind(d["kind"]),
            TensorSpec.from_json(d),
            d.get("target"),
            d.get("aliases"),
        )


@dataclasses.dataclass(frozen=True)
class Signature:
    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]

    def inputs_of(self, *kinds: InputKind) -> tuple[InputSpec, ...]:
        return tuple(i for i in self.inputs if i.kind in kinds)

    def outputs_of(self, *kinds: OutputKind) -> tuple[OutputSpec, ...]:
        return tuple(o for o in self.outputs if o.kind in kinds)

    @property
    def user_inputs(self) -> tuple[InputSpec, ...]:
        return self.inputs_of(InputKind.USER_INPUT)

    @property
    def state_inputs(self) -> tuple[InputSpec, ...]:
        return self.inputs_of(*STATE_INPUTS)

    def aliasing(self) -> dict[str, str]:
        """Output name -> the input placeholder it replaces."""
        return {o.name: o.aliases for o in self.outputs if o.aliases}

    def to_json(self) -> dict[str, Any]:
        return {
            "inputs": [i.to_json() for i in self.inputs],
            "outputs": [o.to_json() for o in self.outputs],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Signature:
        return Signature(
            tuple(InputSpec.from_json(i) for i in d["inputs"]),
            tuple(OutputSpec.from_json(o) for o in d["outputs"]),
        )
