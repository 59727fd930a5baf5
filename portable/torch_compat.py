"""Where portable leans on torch internals, the shims live here.

`quiet_internal_warnings()`: torch 2.13 deep-copies its own pytree specs inside
`ExportedProgram` and `GraphModule` copies and warns about its own deprecated `LeafSpec` check.
The warning is about torch's code, not the user's, so it is silenced around those calls only.

`quiet_onnx_registry()`: torch.onnx logs a warning for every torchvision op it cannot register
when torchvision is absent (which portable does not need); silenced around the export only."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator

import torch.fx

__all__ = ["copy_graph_module", "quiet_internal_warnings", "quiet_onnx_registry"]

_ONNX_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def quiet_internal_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
        )
        yield


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of `gm` (graph and metadata), without torch's internal warning."""
    with quiet_internal_warnings():
        return copy.deepcopy(gm)


@contextlib.contextmanager
def quiet_onnx_registry() -> Iterator[None]:
    logger = logging.getLogger(_ONNX_REGISTRY_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
