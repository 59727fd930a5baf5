"""Constructs of real models that capture cannot take, recognized by what they are, with the
setting or rewrite that makes the model capturable.

torch.export and the verifier report what they saw (a data-dependent loop, `aten.sort` outside
the opset); a user needs the model's own remedy. Two kinds of recognizers:

- on the exported graph, before anything else runs (`refuse_known_ops`): higher-order ops no
  backend can lower, e.g. flex attention;
- on the model, after a failure (`explain`): when the failing node or line lies inside a
  recognized module (a Hugging Face experts module running a data-dependent implementation),
  the error is restated with that module's remedy. Capturable settings of the same module are
  left alone, so an unrelated failure keeps its own message.

torch.export failures inside library functions (flex attention on CPU) are remedies of
`diagnose.REMEDIES`, which uses this module's texts.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Callable

import torch
import torch.fx

from ..errors import CaptureError
from ..ir.source import SourceLoc

__all__ = ["FLEX_ATTENTION_FIX", "HF_EXPERTS_FIX", "explain", "hf_experts", "refuse_known_ops"]

FLEX_ATTENTION_FIX = (
    "use F.scaled_dot_product_attention, which capture turns into portable::attention: "
    "is_causal=True for a causal mask_mod (torchtitan: attn_type='sdpa'), or for another "
    "mask_mod a boolean attn_mask built from it with "
    "torch.nn.attention.flex_attention.create_mask(mask_mod, B, H, Q_LEN, KV_LEN)"
)
FLEX_ATTENTION_MEANING = (
    "flex attention is a torch.compile higher-order op: its score_mod / mask_mod are Python "
    "functions that only inductor compiles, and no portable backend can lower it"
)

# -- graph recognizers ------------------------------------------------------------------------

_REFUSED_HIGHER_ORDER_OPS = {
    "flex_attention": (FLEX_ATTENTION_MEANING, FLEX_ATTENTION_FIX),
    "flex_attention_backward": (FLEX_ATTENTION_MEANING, FLEX_ATTENTION_FIX),
}


def refuse_known_ops(
    gm: torch.fx.GraphModule, source_of: Callable[[torch.fx.Node], SourceLoc | None]
) -> None:
    """Raise a CaptureError with the remedy for the first node of a refused higher-order op."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(
            node.target, torch._ops.HigherOrderOperator
        ):
            continue
        known = _REFUSED_HIGHER_ORDER_OPS.get(node.target.name())
        if known is not None:
            src = source_of(node)
            raise CaptureError(
                known[0],
                op=f"higher_order.{node.target.name()}",
                module=src.module if src else None,
                source=src.location() if src else None,
                fix=known[1],
            )


# -- model recognizers ------------------------------------------------------------------------

# Hugging Face experts implementations (transformers >= 5: `experts_implementation=`) that
# capture takes, and why each other one cannot be captured.
HF_CAPTURABLE_EXPERTS = ("batched_mm",)
_HF_EXPERTS_WHY = {
    "eager": "loops over the experts that received tokens (`nonzero`), so the loop count and "
    "every shape in it depend on the routing",
    "grouped_mm": "sorts the (token, expert) pairs by expert (`aten.sort`) and multiplies "
    "groups whose sizes depend on the routing (grouped_mm offsets), which the portable opset "
    "does not declare",
}
HF_EXPERTS_FIX = (
    "switch the model to the static-shape experts before capture: "
    "model.set_experts_implementation('batched_mm') (or from_pretrained(..., "
    "experts_implementation='batched_mm')); it gathers each (token, expert) pair's weights, so "
    "its memory grows with tokens x top-k x expert size"
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """A module of the model that capture cannot take as configured."""

    path: str  # module path in the model, e.g. "model.layers.0.mlp.experts"
    module: torch.nn.Module
    what: str
    fix: str


def hf_experts(model: torch.nn.Module) -> list[Finding]:
    """Hugging Face experts modules whose `experts_implementation` capture cannot take."""
    found = []
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if not (
            type(module).__module__.startswith("transformers.")
            and hasattr(module, "_is_expert_parallel")
            and config is not None
            and hasattr(config, "_experts_implementation")
        ):
            continue
        impl = config._experts_implementation or "eager"
        if impl in HF_CAPTURABLE_EXPERTS:
            continue
        why = _HF_EXPERTS_WHY.get(impl, "is a device kernel that portable backends do not have")
        what = (
            f"the Hugging Face experts module {type(module).__name__} runs "
            f"experts_implementation={impl!r}, which {why}"
        )
        found.append(Finding(path, module, what, HF_EXPERTS_FIX))
    return found


def _hf_experts_failure(error: CaptureError, model: torch.nn.Module) -> CaptureError | None:
    for finding in hf_experts(model):
        if _within(error, finding):
            return CaptureError(
                finding.what,
                op=error.op,
                module=finding.path or "<root>",
                source=error.source,
                fix=finding.fix,
                details=f"capture said: {error.what}",
            )
    return None


# failure recognizers, tried in order: (error, model) -> the restated error, or None
RECOGNIZERS = (_hf_experts_failure,)


def explain(error: CaptureError, model: torch.nn.Module) -> CaptureError:
    """`error` restated with the remedy of the recognized module it arose in (its module path,
    or its source line within the module's class or the Hugging Face experts integration).
    Otherwise `error` itself."""
    for recognize in RECOGNIZERS:
        explained = recognize(error, model)
        if explained is not None:
            return explained
    return error


_SOURCE = re.compile(r"(?P<file>.+?):(?P<line>\d+)(?:\s|$)")


def _within(error: CaptureError, finding: Finding) -> bool:
    if error.module and (
        error.module == finding.path or error.module.startswith(finding.path + ".")
    ):
        return True
    match = _SOURCE.match(error.source or "")
    if match is None:
        return False
    file, line = os.path.realpath(match["file"]), int(match["line"])
    if file.replace(os.sep, "/").endswith("transformers/integrations/moe.py"):
        return True
    try:
        lines, start = inspect.getsourcelines(type(finding.module))
        cls_file = os.path.realpath(inspect.getsourcefile(type(finding.module)) or "")
    except (OSError, TypeError):
        return False
    return file == cls_file and start <= line < start + len(lines)
