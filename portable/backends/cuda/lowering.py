"""Program -> torch.fx GraphModules over PyTorch ops and Triton kernels.

Two graphs come out, both over the program's flat signature (placeholders in signature order):

- the **export graph** (arch-neutral): portable ops that PyTorch covers become ATen ops
  (`attention` -> `aten.scaled_dot_product_attention`, the norms -> `aten.rms_norm` /
  `aten.layer_norm`); the ops that need kernels of their own stay `portable::` ops, which run on
  CPU through portable's reference kernels and on CUDA through the Triton kernels registered in
  `ops.py`. This graph is what the `.pt2` holds.
- one **kernel graph** per arch: the export graph with those `portable::` ops (and ATen's
  softmax, as the scale-mask-softmax kernel with scale 1 and no mask) replaced by direct calls
  of the Triton launchers in `dispatch.py` (so `torch.compile` sees the Triton kernels, and on
  CPU the same graph runs them in Triton's interpreter), and on archs with native MX the
  `dequantize -> matmul` pattern replaced by the block-scaled matmul (`mx_rewrite.py`).

Fake values (`meta["val"]`) are derived from the program's recorded specs (`values.py`), never
taken from capture, so a loaded archive lowers exactly as the fresh capture it was saved from.
Every rewritten node keeps its metadata (fake value, user source line). Each node that does not
simply stay a PyTorch op gets a `Decision` (`decisions.py`) naming what runs it, which the
manifest records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from portable.ir.program import Program
from portable.opset import lookup, op_name
from portable.opset.bind import bind
from portable.torch_compat import copy_graph_module

from . import dispatch
from .decisions import Decision, decision
from .mx_rewrite import rewrite_mx_matmuls
from .targets import CudaArch
from .values import annotate_fake_values

__all__ = ["export_graph", "kernel_graph", "mx_mode", "retarget_devices"]

aten = torch.ops.aten
portable = torch.ops.portable


def _full_args(node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The node's arguments, all positional, defaults filled in (kernel ops have no defaults)."""
    return tuple(bind(node).values()), {}


def _shape(value: Any) -> tuple[int | str, ...]:
    """The recorded shape of a graph value (dims are ints or symbol names); () for a non-node."""
    return tuple(value.meta["tensor"].shape) if isinstance(value, torch.fx.Node) else ()


def sdpa_covers(args: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether PyTorch's scaled_dot_product_attention computes this attention as it is.

    SDPA refuses `attn_mask` together with `is_causal`; everything else portable's attention
    expresses (bool/float masks, top-left causal, scale, grouped kv heads) it takes directly."""
    if args["mask"] is not None and args["is_causal"]:
        return False, "mask and is_causal together (SDPA takes one or the other)"
    return True, ""


def _replace(
    graph: torch.fx.Graph,
    node: torch.fx.Node,
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
) -> torch.fx.Node:
    """A call of `target` takes `node`'s place: same metadata, same users; `node` is erased."""
    with graph.inserting_before(node):
        new = graph.call_function(target, tuple(args), kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


# portable op -> the ATen op that computes exactly what its reference kernel computes
_ATEN_EQUIVALENTS = {
    "portable.rms_norm.default": (
        aten.rms_norm.default,
        ("x", "normalized_shape", "weight", "eps"),
    ),
    "portable.layer_norm.default": (
        aten.layer_norm.default,
        ("x", "normalized_shape", "weight", "bias", "eps"),
    ),
}


def export_graph(program: Program) -> tuple[torch.fx.GraphModule, list[Decision]]:
    """The arch-neutral graph over ATen ops and the kernel-backed portable ops, with the fake
    value of every node in `meta["val"]`."""
    gm = copy_graph_module(program.graph_module)
    annotate_fake_values(gm, program)
    graph = gm.graph
    decisions: list[Decision] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or lookup(node.target) is None:
            continue
        name = op_name(node.target)
        if name == "portable.attention.default":
            a = bind(node)
            covered, why = sdpa_covers(a)
            if not covered:
                decisions.append(decision(node, name, "triton:attention", why))
                continue
            gqa = _shape(a["q"])[-3:-2] != _shape(a["k"])[-3:-2]
            kwargs = {"attn_mask": a["mask"], "is_causal": a["is_causal"], "scale": a["scale"]}
            if gqa:
                kwargs["enable_gqa"] = True
            sdpa = aten.scaled_dot_product_attention.default
            _replace(graph, node, sdpa, (a["q"], a["k"], a["v"]), kwargs)
            decisions.append(decision(node, name, "sdpa"))
        elif name in _ATEN_EQUIVALENTS:
            target, names = _ATEN_EQUIVALENTS[name]
            a = bind(node)
            _replace(graph, node, target, tuple(a[n] for n in names))
        elif name in dispatch.TRITON_OPS:
            decisions.append(decision(node, name, f"triton:{dispatch.TRITON_OPS[name].kernel}"))
    graph.lint()
    gm.recompile()
    return gm, decisions


def mx_mode(program: Program) -> str | None:
    """The mx-quantize pass's mode recorded in the program ("fake" / "real"), or None."""
    record = program.metadata.get("mx_quantize")
    return record.get("mode") if isinstance(record, dict) else None


def retarget_devices(gm: torch.fx.GraphModule, device: torch.device | str) -> int:
    """Point every factory op's `device=` at `device` (capture traced on CPU, so `arange`,
    `full`, `scalar_tensor`, ... say `device=cpu`); returns how many nodes changed."""
    device = torch.device(device)
    changed = 0
    for node in gm.graph.nodes:
        old = node.kwargs.get("device") if node.op == "call_function" else None
        if isinstance(old, torch.device) and old != device:
            node.kwargs = {**node.kwargs, "device": device}
            changed += 1
    if changed:
        gm.recompile()
    return changed


def kernel_graph(
    export_gm: torch.fx.GraphModule, arch: CudaArch, mx_mode: str | None = None
) -> tuple[torch.fx.GraphModule, list[Decision]]:
    """`export_gm` for `arch`: Triton-backed portable ops become kernel ops; `mx_mode` is the
    mx-quantize pass's mode from the program's metadata (None without the pass)."""
    gm = copy_graph_module(export_gm)
    graph = gm.graph
    retarget_devices(gm, "cuda")  # what it runs on; executables retarget to their device
    decisions = rewrite_mx_matmuls(gm, arch, mx_mode)
    for node in list(graph.nodes):
        if node.op != "call_function" or lookup(node.target) is None:
            continue
        if node.target is aten._softmax.default:
            b = bind(node)
            if not b.literal("half_to_float"):
                # softmax(x, dim) == scale_mask_softmax(x, None, 1.0, dim): one fused row kernel
                smax = dispatch.KERNEL_OPS["scale_mask_softmax"].op
                _replace(graph, node, smax, (b.node("self"), None, 1.0, b.literal("dim")))
                decisions.append(
                    decision(node, "aten._softmax.default", "triton:scale_mask_softmax")
                )
                continue
        entry = dispatch.TRITON_OPS.get(op_name(node.target))
        if entry is not None:
            _replace(graph, node, entry.op, *_full_args(node))
    graph.lint()
    gm.recompile()
    return gm, decisions
