"""Where portable leans on torch internals, the shims live here.

`quiet_internal_warnings()`: torch 2.13 deep-copies its own pytree specs inside
`ExportedProgram` and `GraphModule` copies and warns about its own deprecated `LeafSpec` check.
The warning is about torch's code, not the user's, so it is silenced around those calls only.

`lazy_graph_module(graph)` / `copy_graph_lazily(gm)`: a graph module that generates and compiles
its Python code only when it is run or printed (torch's `_LazyGraphModule`): for a program of
tens of thousands of nodes that passes rewrite and nothing runs (an abstract program), each
eager recompile costs seconds.

`quiet_onnx_registry()`: torch.onnx logs a warning for every torchvision op it cannot register
when torchvision is absent (which portable does not need); silenced around the export only."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Iterator

import torch.fx
from torch.fx._lazy_graph_module import _LazyGraphModule

__all__ = [
    "copy_graph_lazily",
    "copy_graph_module",
    "lazy_graph_module",
    "quiet_internal_warnings",
    "quiet_onnx_registry",
]

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


def lazy_graph_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module of `graph` (call_function nodes only: no attributes) whose code is
    generated when it is first run or printed; `recompile()` only marks it stale."""
    return _LazyGraphModule(torch.nn.Module(), graph)


def copy_graph_lazily(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `gm`'s graph (node metadata copied shallowly, as `copy.deepcopy` copies it) in
    a `lazy_graph_module`; `gm` holds call_function nodes only."""
    with quiet_internal_warnings():
        return lazy_graph_module(copy.deepcopy(gm.graph))


@contextlib.contextmanager
def quiet_onnx_registry() -> Iterator[None]:
    logger = logging.getLogger(_ONNX_REGISTRY_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
