"""`dce`: remove ops whose results nothing uses.

Every opset op is pure (graphs are functional: no op writes into its inputs or has side
effects), so an op with no users can go. Placeholders stay (they are the signature), and so does
the output node.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from portable.ir.program import Program

from .base import Pass, PassResult

__all__ = ["DeadCodeElimination", "remove_dead_code"]


def remove_dead_code(graph: torch.fx.Graph) -> int:
    """Erase, in place, every call_function node with no users (transitively); return how many."""
    removed = 0
    for node in reversed(list(graph.nodes)):  # users come after their inputs: one sweep suffices
        if node.op == "call_function" and not node.users:
            graph.erase_node(node)
            removed += 1
    return removed


@dataclasses.dataclass(frozen=True)
class DeadCodeElimination(Pass):
    """Counts: `removed`, the number of ops erased."""

    name = "dce"

    def apply(self, program: Program) -> PassResult:
        if not any(n.op == "call_function" and not n.users for n in program.graph.nodes):
            return PassResult(program, self.report(False, {"removed": 0}))
        out = program.replace()
        removed = remove_dead_code(out.graph)
        out.graph_module.recompile()
        return PassResult(out, self.report(True, {"removed": removed}))
