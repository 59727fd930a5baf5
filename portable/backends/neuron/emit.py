"""Program -> the HLO handed to neuronx-cc: a serialized HloModuleProto with a tuple root.

The program is lowered by the shared JAX rules (`backends.xla.lowering.lower`, platform
"neuron", state donated so parameters and optimizer state alias their outputs). The StableHLO is
converted to HLO with `return_tuple=True` (JAX's own HLO has a bare root for one output; neuronx-cc
wants a tuple). Python stack frames are left out of locations (traceback limit 0): they point at
the lowering rules, not at the user's code, and would make the bytes depend on where `portable`
is installed. What remains is deterministic: each instruction's metadata op_name
`jit(fn)/<node name>/<primitive>`, which the validator maps back to the node and the user's line.
The module id (a process-wide counter) is dropped, and each collective's replica groups are
written in both the new and the deprecated proto field (proto_groups.py).

jax.jit drops inputs the program never reads (batch-norm counters in eval mode, for instance)
unless it is told to keep them; `HloArtifacts.kept` records which signature inputs are HLO
parameters, and the io spec lists the others as unused.

A per-rank program whose collectives need the rank's coordinate (`rank_input=True`, see
collectives.py) is traced with one more argument after the signature's inputs: the NxD rank, an
int32 scalar. It is the last HLO parameter (`HloArtifacts.rank_parameter`), never aliased.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from portable.ir.program import Program

from .proto_groups import fill_replica_groups
from .wire import drop_field

if TYPE_CHECKING:
    import jax
    from jax._src.lib.mlir import ir

__all__ = ["HloArtifacts", "lower_to_hlo"]


@dataclasses.dataclass(frozen=True)
class HloArtifacts:
    proto: bytes  # serialized HloModuleProto: the compiler input (graph.hlo)
    stablehlo: str  # StableHLO with named locations (graph.stablehlo.mlir, secondary)
    kept: tuple[int, ...]  # signature input index of each HLO parameter, in parameter order
    rank_parameter: int | None = None  # parameter number of the int32 rank input, if any


def lower_to_hlo(
    program: Program,
    platform: str = "neuron",
    collectives: Any = None,
    rank_input: bool = False,
    rules: Any = None,
) -> HloArtifacts:
    """Lower `program` for `platform` and convert it to a tuple-rooted HloModuleProto.

    `collectives`: how a per-rank program's collectives lower (collectives.py); `rank_input`:
    trace with the int32 rank as the last argument, bound with `collectives.with_rank`; `rules`:
    rules of the backend's own graph targets (native MX GEMMs, mx_native.py)."""
    from jax._src import config as jax_config
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client

    from ..xla.lowering import lower

    count = len(program.signature.inputs)
    with jax_config.traceback_in_locations_limit(0):
        lowered = lower(
            program,
            platform,
            donate=True,
            collectives=collectives,
            rank_input=rank_input,
            rules=rules,
        )
        numbers = _kept_inputs(lowered, count + rank_input)
        kept = tuple(k for k in numbers if k < count)
        rank_parameter = len(kept) if count in numbers else None  # dropped if never read
        module = lowered.compiler_ir("stablehlo")
        assert module is not None  # None only for a dialect jax does not know
        _alias_as_signed(module, program, kept)
        bytecode = mlir.module_to_bytecode(module)
        stablehlo = mlir.module_to_string(module, enable_debug_info=True)
    computation = xla_client._xla.mlir.mlir_module_to_xla_computation(
        bytecode, use_tuple_args=False, return_tuple=True
    )
    proto = drop_field(computation.as_serialized_hlo_module_proto(), _MODULE_ID)
    proto = fill_replica_groups(proto)  # both proto fields, for older compilers (proto_groups.py)
    return HloArtifacts(proto, stablehlo, kept, rank_parameter)


def _alias_as_signed(module: ir.Module, program: Program, kept: tuple[int, ...]) -> None:
    """Make input_output_alias exactly the signature's aliasing (updated output k replaces the
    input it names). jax.jit pairs each donated input with the first unclaimed output of the same
    shape and dtype, which for scalars (the step counter) can be the loss."""
    from jax._src.lib.mlir import ir

    sig = program.signature
    parameter = {sig.inputs[k].name: number for number, k in enumerate(kept)}
    aliases = {
        parameter[out.aliases]: index
        for index, out in enumerate(sig.outputs)
        if out.aliases in parameter
    }
    main = next(
        op
        for op in module.body.operations
        if ir.StringAttr(op.attributes["sym_name"]).value == "main"
    )
    with module.context:
        i32 = ir.IntegerType.get_signless(32)
        attrs = []
        for number, old in enumerate(ir.ArrayAttr(main.attributes["arg_attrs"])):
            old = ir.DictAttr(old)
            entries = {
                old[i].name: old[i].attr
                for i in range(len(old))
                if old[i].name not in ("tf.aliasing_output", "jax.buffer_donor")
            }
            if number in aliases:
                entries["tf.aliasing_output"] = ir.IntegerAttr.get(i32, aliases[number])
            attrs.append(ir.DictAttr.get(entries))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)


def _kept_inputs(lowered: jax.stages.Lowered, count: int) -> tuple[int, ...]:
    """Inputs that are HLO parameters: jax.jit drops unused arguments (keep_unused=False) and
    records which it kept; without that record every input is a parameter."""
    lowering = getattr(lowered, "_lowering", None)
    kept = getattr(lowering, "compile_args", {}).get("kept_var_idx")
    return tuple(sorted(kept)) if kept is not None else tuple(range(count))


# HloModuleProto field 5 is `int64 id`, drawn from a process-wide counter of modules created: the
# only part of the proto that differs between two lowerings of the same program. Zero (absent) is
# its default; nothing reads it.
_MODULE_ID = 5
