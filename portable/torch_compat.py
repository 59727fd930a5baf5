"""Where portable leans on torch internals, the shims live here.

`quiet_internal_warnings()`: torch 2.13 deep-copies its own pytree specs inside
`ExportedProgram` and `GraphModule` copies and warns about its own deprecated `LeafSpec` check.
The warning is about torch's code, not the user's, so it is silenced around those calls only."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import torch.fx

__all__ = ["copy_graph_module", "quiet_internal_warnings"]


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
