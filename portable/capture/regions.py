"""Refuse `torch.autocast` regions by name, at the user's line, right after export.

Non-strict torch.export turns `with torch.autocast(...)` into a `wrap_with_autocast` node over a
sub-graph. Nothing later sees inside it: the composite ops there are not made `portable::` ops,
their decompositions bring ops outside the opset, and errors point at the sub-graph's generated
code (`<eval_with_key>.91:104`), a line the user cannot act on. Mixed precision is not captured
yet (it comes with training recipes), so an enabled region is refused here, naming its device,
dtype and first line. A disabled region (`enabled=False`, as Hugging Face's rotary embeddings use
to force float32) changes nothing and is kept.
"""

from __future__ import annotations

import torch
import torch.fx

from ..errors import CaptureError
from ..ir.source import SourceLoc, from_fx_meta
from .diagnose import is_user_file

__all__ = ["refuse_autocast"]

_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


def refuse_autocast(gm: torch.fx.GraphModule, strip_prefix: str = "") -> None:
    """CaptureError for the first enabled `torch.autocast` region in `gm` or its sub-graphs."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target is _AUTOCAST and node.args[2]:
                _refuse(module, node, strip_prefix)


def _refuse(owner: torch.fx.GraphModule, node: torch.fx.Node, strip_prefix: str) -> None:
    # wrap_with_autocast(device_type, dtype, enabled, cache_enabled, body, *operands); `body` is
    # a get_attr of the graph module that holds the node
    device, dtype, body = node.args[0], node.args[1], node.args[4]
    assert isinstance(body, torch.fx.Node) and isinstance(body.target, str)  # a get_attr
    src = _first_user_line(getattr(owner, body.target), strip_prefix)
    raise CaptureError(
        f"torch.autocast({device}, dtype={dtype}) is not captured yet: mixed precision comes "
        "with training recipes",
        op="torch.autocast",
        module=src.module if src else None,
        source=src.location() if src else None,
        fix="remove the autocast region and capture in one precision (cast explicitly where "
        f"you need it: model.to({dtype}) and inputs .to({dtype}))",
    )


def _first_user_line(body: torch.fx.GraphModule, strip_prefix: str) -> SourceLoc | None:
    """The source of the region's first op that comes from the user's code."""
    for node in body.graph.nodes:
        src = from_fx_meta(node.meta, is_user_file, strip_prefix)
        if src is not None and src.file is not None:
            return src
    return None
