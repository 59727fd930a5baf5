"""Give joint (forward + backward) graph nodes the user's source locations.

AOT autograd retraces the program to build the joint graph, and the stack traces it records
point at its own generated code. So:
1. forward nodes: match them structurally (same op, same inputs) to a forward-only
   decomposition of the same program, whose nodes carry the user's source;
2. backward nodes (best effort): a backward op reads values the forward op it differentiates
   also read (its saved inputs, its weights). For each such value take its first forward
   consumer; the latest of those is the op being differentiated, and lends its source.
   Gradient plumbing that reads only other backward values follows its latest input.
"""

from __future__ import annotations

import torch.fx

from ..ir.source import SourceLoc
from ..opset import op_name


def _keys(graph: torch.fx.Graph, ids: dict[tuple, int]) -> dict[torch.fx.Node, int]:
    """A structural id per node: equal ids mean the same op applied to structurally equal
    inputs (placeholders by position). `ids` interns keys across graphs, so keys stay flat."""
    keys: dict[torch.fx.Node, int] = {}
    position = 0

    def key_of(value):
        if isinstance(value, torch.fx.Node):
            return ("node", keys[value])
        if isinstance(value, (list, tuple)):
            return tuple(key_of(v) for v in value)
        return repr(value)

    for node in graph.nodes:
        if node.op == "placeholder":
            key: tuple = ("placeholder", position)
            position += 1
        elif node.op == "call_function":
            kwargs = tuple(sorted((k, key_of(v)) for k, v in node.kwargs.items()))
            key = (op_name(node.target), key_of(node.args), kwargs)
        else:
            continue
        keys[node] = ids.setdefault(key, len(ids))
    return keys


def restore_sources(joint: torch.fx.Graph, forward: torch.fx.Graph) -> int:
    """Set `meta["source"]` on joint nodes from `forward`'s; returns how many nodes got one."""
    ids: dict[tuple, int] = {}
    by_key: dict[int, SourceLoc] = {}
    for node, key in _keys(forward, ids).items():
        src = node.meta.get("source")
        if isinstance(src, SourceLoc):
            by_key.setdefault(key, src)
    matched: set[torch.fx.Node] = set()
    for node, key in _keys(joint, ids).items():
        src = by_key.get(key)
        if src is not None and node.op == "call_function":
            node.meta["source"] = src
            matched.add(node)
    position = {node: i for i, node in enumerate(joint.nodes)}

    def first_forward_user(value: torch.fx.Node) -> torch.fx.Node | None:
        users = [u for u in value.users if u in matched]
        return min(users, key=position.__getitem__) if users else None

    count = len(matched)
    for node in joint.nodes:
        if node.op != "call_function" or node in matched:
            continue
        candidates = [
            first_forward_user(arg)
            for arg in node.all_input_nodes
            if arg in matched or arg.op == "placeholder"
        ]
        users = [c for c in candidates if c is not None and position[c] < position[node]]
        if not users:  # pure gradient plumbing (views, adds): follow the gradient
            users = [a for a in node.all_input_nodes if isinstance(a.meta.get("source"), SourceLoc)]
        if users:
            node.meta["source"] = max(users, key=position.__getitem__).meta["source"]
            count += 1
    return count
