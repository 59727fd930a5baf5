"""The `portable` torch.library namespace. Importing `portable.opset` defines every op once."""

from __future__ import annotations

import torch

NAMESPACE = "portable"

# One fragment for the whole process: defining an op twice is an error in torch.library.
_LIB = torch.library.Library(NAMESPACE, "DEF")


def define(schema: str, tags: tuple[torch.Tag, ...] = ()) -> None:
    """Define `portable::<schema>`."""
    _LIB.define(schema, tags=tags)
