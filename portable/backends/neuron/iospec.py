"""`io_spec.json`: the compiled program's ordered inputs and outputs, as a Neuron runtime feeds them.

Inputs are the HLO parameters in order (the signature's inputs: parameters, buffers, constants,
optimizer state, then the batch; `index` is the parameter number); outputs are the root tuple's
elements in order. Each entry has its name, role (the signature kind), weight key, shape and
dtype; aliasing comes from the HLO's `input_output_alias` (what the compiler will honour):
`donated_to` on an input, `alias` on an output, each by index and name. Signature inputs the
program never reads are not parameters: they are listed in `unused_inputs` and not passed.
A per-rank program that needs its rank's coordinate has one more, last input: `rank_id`, role
"rank", an int32 scalar the runtime sets to the NxD rank of the core (collectives.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from portable.ir.program import Program
from portable.ir.signature import TensorSpec

from .collectives import RANK_INPUT
from .hlo import HloModule

__all__ = ["FORMAT_VERSION", "io_spec"]

FORMAT_VERSION = 1


def io_spec(
    program: Program,
    module: HloModule,
    kept: Sequence[int] | None = None,
    rank_parameter: int | None = None,
) -> dict:
    """The io spec of `program` lowered to `module`; `kept` lists the signature inputs that are
    HLO parameters, in parameter order (default: all). The others are `unused_inputs`.
    `rank_parameter`: the parameter number of the int32 rank input, if the HLO has one."""
    sig = program.signature
    kept = list(range(len(sig.inputs)) if kept is None else kept)
    params = module.parameters()
    out_to_param = {
        a.output_index[0]: a.parameter
        for a in module.aliases
        if len(a.output_index) == 1 and not a.parameter_index
    }
    param_to_out = {p: o for o, p in out_to_param.items()}
    inputs = []
    for number, k in enumerate(kept):
        spec = sig.inputs[k]
        entry = _tensor(number, spec.name, spec.kind.value, spec.target, spec.spec)
        entry["hlo_type"] = str(params[number].leaves[0]) if number < len(params) else None
        out = param_to_out.get(number)
        entry["donated_to"] = (
            {"index": out, "name": sig.outputs[out].name} if out is not None else None
        )
        inputs.append(entry)
    if rank_parameter is not None:
        entry = {
            "index": rank_parameter,
            "name": RANK_INPUT,
            "role": "rank",
            "target": None,
            "shape": [],
            "dtype": "int32",
            "hlo_type": str(params[rank_parameter].leaves[0]),
            "donated_to": None,
            "value": "the NxD rank of the core running the program (its replica id)",
        }
        inputs.append(entry)
    outputs = []
    for index, out_spec in enumerate(sig.outputs):
        entry = _tensor(index, out_spec.name, out_spec.kind.value, out_spec.target, out_spec.spec)
        param = out_to_param.get(index)
        entry["alias"] = (
            {"index": param, "name": sig.inputs[kept[param]].name} if param is not None else None
        )
        outputs.append(entry)
    unused = [
        {"name": spec.name, "role": spec.kind.value, "target": spec.target}
        for k, spec in enumerate(sig.inputs)
        if k not in set(kept)
    ]
    return {
        "format_version": FORMAT_VERSION,
        "program": program.name,
        "kind": program.kind.value,
        "inputs": inputs,
        "outputs": outputs,
        "unused_inputs": unused,
    }


def _tensor(
    index: int, name: str, role: str, target: str | None, spec: TensorSpec
) -> dict[str, Any]:
    return {
        "index": index,
        "name": name,
        "role": role,
        "target": target,
        "shape": [int(d) for d in spec.shape],
        "dtype": str(spec.dtype).removeprefix("torch."),
    }
