"""Program -> JAX function -> StableHLO / HLO.

`jax_function(program, platform)` walks the graph once per trace and applies the rule of each
node; every op must have a rule before anything is traced (LoweringError otherwise, naming the op,
the backend, the user's line and the rules that do exist). `lower(program, platform)` traces it with
`jax.jit` over the signature's shapes and dtypes, under x64 so int64 indices keep their type.
Training-step state inputs are donated, so updated parameters and optimizer state alias their
inputs in the HLO (`input_output_alias`).
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Mapping
from typing import Any

import jax
import torch.fx

from portable.errors import LoweringError
from portable.ir.program import Program, ProgramKind
from portable.ir.signature import InputKind
from portable.ir.source import source_of
from portable.opset import op_name

from .dtypes import to_jax
from .rules import RuleContext, load_rules

__all__ = ["abstract_inputs", "jax_function", "lower"]


def _missing(node: torch.fx.Node, name: str, platform: str, known: frozenset[str]) -> LoweringError:
    src = source_of(node)
    close = difflib.get_close_matches(name, sorted(known), n=6, cutoff=0.5)
    return LoweringError(
        f"backend {platform} has no lowering rule for {name}",
        backend=platform,
        op=name,
        module=src.module if src else None,
        source=src.location() if src else None,
        fix=(f"supported alternatives: {', '.join(close)}; " if close else "")
        + "rewrite the model code with a supported op, or run on `cpu`",
    )


def _resolve(
    program: Program, platform: str, extra: Mapping[Any, Callable] | None = None
) -> dict[torch.fx.Node, Callable]:
    table = load_rules()
    rules = {}
    for node in program.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if extra and node.target in extra:  # a backend's own node (not an opset op)
            rules[node] = extra[node.target]
            continue
        name = op_name(node.target)
        rule = table.get(name, platform)
        if rule is None:
            raise _missing(node, name, platform, table.names(platform))
        rules[node] = rule
    return rules


def jax_function(
    program: Program,
    platform: str,
    collectives: Any = None,
    rules: Mapping[Any, Callable] | None = None,
) -> Callable[..., tuple]:
    """A JAX-traceable function of the flat graph inputs returning the flat outputs.

    `collectives` lowers the portable collectives of a per-rank program (see RuleContext);
    `rules` maps node targets outside the opset that a backend put in the graph to their rules
    (the neuron backend's native MX GEMMs), ahead of the table."""
    rules = _resolve(program, platform, rules)
    nodes = list(program.graph.nodes)

    def fn(*flat):
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(flat)

        def load(value):
            return torch.fx.node.map_arg(value, env.__getitem__)

        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "call_function":
                args, kwargs = load(node.args), load(node.kwargs)
                if node.target is operator.getitem:
                    value, index = args
                    env[node] = value[index]
                    continue
                try:
                    # the node name lands in each HLO instruction's metadata (op_name), which is
                    # how validators map an instruction back to the node and the user's line
                    with jax.named_scope(node.name):
                        env[node] = rules[node](
                            RuleContext(node, platform, collectives), *args, **kwargs
                        )
                except LoweringError:
                    raise
                except Exception as exc:  # a rule's bug or an unsupported argument combination
                    src = source_of(node)
                    raise LoweringError(
                        f"lowering {op_name(node.target)} for {platform} failed: {type(exc).__name__}: {exc}",
                        backend=platform,
                        op=op_name(node.target),
                        module=src.module if src else None,
                        source=src.location() if src else None,
                        fix="report this with the program (`portable inspect --text`); run on `cpu` meanwhile",
                    ) from exc
            elif node.op == "output":
                (results,) = node.args  # one flat tuple of values
                return tuple(load(results))
        raise AssertionError("graph without output")  # unreachable: the verifier requires one

    return fn


def abstract_inputs(program: Program) -> list[jax.ShapeDtypeStruct]:
    return [
        jax.ShapeDtypeStruct(tuple(int(d) for d in i.spec.shape), to_jax(i.spec.dtype))
        for i in program.signature.inputs
    ]


def donated(program: Program) -> tuple[int, ...]:
    """Indices of inputs whose updated value the program returns (state of a training step)."""
    if program.kind is not ProgramKind.TRAINING_STEP:
        return ()
    aliased = set(program.signature.aliasing().values())
    return tuple(
        i
        for i, spec in enumerate(program.signature.inputs)
        if spec.kind is not InputKind.USER_INPUT and spec.name in aliased
    )


def lower(
    program: Program,
    platform: str,
    *,
    donate: bool = True,
    collectives: Any = None,
    rank_input: bool = False,
    rules: Mapping[Any, Callable] | None = None,
) -> jax.stages.Lowered:
    """Trace the program with jax.jit and lower it (StableHLO; `.compiler_ir("hlo")` for HLO).

    `rank_input`: one more argument after the signature's inputs, the int32 rank (`rank_id`),
    bound into the collectives with `collectives.with_rank` (per-rank Neuron HLO); `rules` as
    in `jax_function`."""
    if program.metadata.get("symbolic_dims"):
        raise LoweringError(
            f"{program.name} has dynamic dims {sorted(program.metadata['symbolic_dims'])}",
            backend=platform,
            fix="XLA and Neuron compile static shapes: capture one program per shape bucket",
        )
    extra = {}
    if rank_input:

        def fn(*flat, rank_id):
            # the rank is bound per trace; a keyword argument is flattened after the inputs and
            # named `rank_id` in the HLO metadata
            return jax_function(program, platform, collectives.with_rank(rank_id), rules)(*flat)

        extra["rank_id"] = jax.ShapeDtypeStruct((), "int32")
    else:
        fn = jax_function(program, platform, collectives, rules)
    with jax.enable_x64(True):
        jitted = jax.jit(fn, donate_argnums=donated(program) if donate else ())
        return jitted.lower(*abstract_inputs(program), **extra)
