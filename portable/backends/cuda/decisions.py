"""`Decision`: how one node of a cuda graph runs, as the manifest records it.

Both rewrites of the cuda lowering make them: the export-graph rewrite (`lowering.py`: SDPA, the
Triton kernels) and the MX matmul rewrite (`mx_rewrite.py`: native or emulated MX).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from portable.ir.source import source_of

__all__ = ["Decision", "decision"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """How one node runs: `impl` is "pytorch", "sdpa", "triton:<kernel>", "native-mx" or
    "emulated-mx"; `reason` says why when it is not the obvious choice."""

    node: str
    op: str
    impl: str
    reason: str = ""
    source: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in ("", None)}


def decision(node: torch.fx.Node, op: str, impl: str, reason: str = "") -> Decision:
    """The Decision for `node`, located at the user's source line the node carries."""
    src = source_of(node)
    return Decision(node.name, op, impl, reason, src.location() if src else None)
