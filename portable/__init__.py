"""portable: capture a PyTorch model once; lower it to Trainium, NVIDIA GPUs, XLA, ONNX and CPU.

program = portable.capture(model, (x,))               # inference
step = portable.capture(model, batch, loss_fn=..., optimizer=portable.optim.AdamW(lr=1e-3))
run = portable.compile(program, backend="cpu")
program.save("model.portable"); portable.load("model.portable")

The module itself is the `@portable` decorator: `import portable` then `@portable(...)` or
`@portable` (the same as `from portable import portable`).
"""

from __future__ import annotations

import sys
import types

from . import limits, optim, parallel, schedules
from .api import compile, lower
from .archive import load
from .capture import ModelSpec, capture, capture_spec, portable, spec_of
from .errors import (
    AbstractProgramError,
    ArchiveError,
    BackendError,
    CaptureError,
    InputError,
    LoweringError,
    PassError,
    PlanError,
    PortableError,
    RegistryError,
    ResourceLimitError,
    VerifyError,
)
from .ir.plan import Experts, Mesh, PartitionSpec, Pipeline, Plan
from .ir.program import Program, ProgramKind
from .ir.signature import InputKind, OutputKind
from .recipe import LossScale, Precision, Recipe
from .runtime import Executable, StepResult
from .verify import verify
from .version import __version__ as __version__


class _Module(types.ModuleType):
    """The `portable` package, callable as the `@portable` decorator."""

    def __call__(self, *args, **kwargs):
        return portable(*args, **kwargs)


_Module.__call__.__doc__ = portable.__doc__
sys.modules[__name__].__class__ = _Module

__all__ = [
    "AbstractProgramError",
    "ArchiveError",
    "BackendError",
    "CaptureError",
    "Executable",
    "Experts",
    "InputError",
    "InputKind",
    "LossScale",
    "LoweringError",
    "Mesh",
    "ModelSpec",
    "OutputKind",
    "PartitionSpec",
    "PassError",
    "Pipeline",
    "Plan",
    "PlanError",
    "PortableError",
    "Precision",
    "Program",
    "ProgramKind",
    "Recipe",
    "RegistryError",
    "ResourceLimitError",
    "StepResult",
    "VerifyError",
    "capture",
    "capture_spec",
    "compile",
    "limits",
    "load",
    "lower",
    "optim",
    "parallel",
    "portable",
    "schedules",
    "spec_of",
    "verify",
]
