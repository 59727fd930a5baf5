"""Lowering rules: portable opset op -> JAX (`jax.lax` / `jax.numpy`), one table for all targets.

A rule is `rule(ctx, *args, **kwargs) -> jax value (or tuple)`, where graph values are already
JAX arrays and the rest are the node's literal arguments. Rules are registered per opset name,
optionally with a per-platform override (JAX's `register_lowering(prim, rule, platform=...)`):

    @RULES.register("aten.gelu.default")                       # generic
    def gelu(ctx, x, approximate="none"): ...

    @RULES.register("aten.gelu.default", platform="neuron")    # Trainium form
    def gelu_neuron(ctx, x, approximate="none"): ...

Platforms: "xla" (XLA:CPU execution) and "neuron" (the HLO handed to neuronx-cc).
Rule modules register themselves on import; `load_rules()` imports them all.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import torch.fx

from portable.ir.signature import TensorSpec

__all__ = ["PLATFORMS", "RULES", "RuleContext", "RuleTable", "load_rules"]

PLATFORMS = ("xla", "neuron")
_MODULES = (
    "elementwise",
    "math",
    "reductions",
    "sorting",
    "shape",
    "creation",
    "nn",
    "resample",
    "losses",
    "portable_ops",
    "attention",
    "mx",
    "symbolic",
    "special",
    "bessel",
    "selection",
    "spatial",
    "linalg",
    "neuron_overrides",
)


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a rule may look at besides its arguments."""

    node: torch.fx.Node
    platform: str
    # how collectives over groups of more than one rank lower (None: single-rank program): an
    # object with the `CollectiveRuntime` methods returning JAX values, set by the multi-device
    # lowerings (backends/xla/spmd.py: named mesh axes under shard_map; backends/neuron: explicit
    # replica groups of global ranks)
    collectives: Any = None

    @property
    def out(self) -> TensorSpec | tuple | None:
        """The node's recorded result spec (shape and dtype)."""
        return self.node.meta.get("tensor")


Rule = Callable[..., Any]


class RuleTable:
    def __init__(self) -> None:
        self._generic: dict[str, Rule] = {}
        self._override: dict[tuple[str, str], Rule] = {}

    def register(self, *names: str, platform: str | None = None) -> Callable[[Rule], Rule]:
        """Register the decorated rule for each opset name (generic, or for one platform)."""
        if platform is not None and platform not in PLATFORMS:
            raise ValueError(f"unknown platform {platform!r}; platforms: {PLATFORMS}")

        def wrap(fn: Rule) -> Rule:
            for name in names:
                key = name if platform is None else (name, platform)
                table = self._generic if platform is None else self._override
                if key in table:
                    raise ValueError(f"lowering rule for {key} registered twice")
                table[key] = fn  # type: ignore[index]
            return fn

        return wrap

    def get(self, name: str, platform: str) -> Rule | None:
        return self._override.get((name, platform)) or self._generic.get(name)

    def names(self, platform: str) -> frozenset[str]:
        return frozenset(self._generic) | frozenset(n for n, p in self._override if p == platform)

    def overridden(self, platform: str) -> frozenset[str]:
        return frozenset(n for n, p in self._override if p == platform)


RULES = RuleTable()
_loaded = False


def load_rules() -> RuleTable:
    """Import every rule module (they register into RULES) once; return the table."""
    global _loaded
    if not _loaded:
        for module in _MODULES:
            importlib.import_module(f"{__name__}.{module}")
        _loaded = True
    return RULES
