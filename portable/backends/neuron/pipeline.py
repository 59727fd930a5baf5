"""Pipelined training steps for Trainium: per-stage Neuron HLO, per-cut transfer HLO, a rank map.

`lower_pipeline(step, target)` takes a training step whose plan has a `Pipeline` (PP alone, or
PP x DP / TP / CP with the plan's rules):

1. stages: `per_rank_program` (portable/distributed/launch.py) partitions the step over the
   plan's other axes (spmd-partition over `pipeline_free(plan)`), then `split_stages` cuts it.
   The stage programs have local (per-rank) shapes and hold portable collectives over tp / dp.
2. stage HLO: every stage's forward, backward and update program is lowered by the neuron backend
   (`NeuronBackend.lower_with_layout`), ONE HLO PER STAGE PROGRAM (middle stages are not
   deduplicated: their programs differ in names and parameter keys, and a per-stage NEFF is what
   NxD compiles). Collectives list replica groups of the FULL mesh in NxD order [PP, DP, CP, TP]
   (collectives.RankLayout of the plan's mesh, pp included): a tp all-reduce of stage s has the
   groups of every pipeline rank, each group within one stage, as NxD's
   `get_tensor_model_parallel_replica_groups()` lists them. Each stage HLO is validated against
   that layout (groups partition the world, size = axis size). A program whose collectives need
   the rank's coordinate (local_shard) takes the NxD rank as its last int32 parameter.
3. transfers: the contract says stage transfers are 2-rank collectives and lists
   `collective-permute` among the collectives neuronx-cc takes. The activation a stage sends and
   the gradient sent back are therefore SEPARATE small HLOs, one per cut and direction
   (`<model>.cut<s>.activation`: stage s -> s + 1; `<model>.cut<s>.gradient`: s + 1 -> s), each a
   tuple of `collective-permute`s (one per tensor, cross-replica, no channel id) whose
   source_target_pairs are NxD ranks: (rank of (pp = s, c), rank of (pp = s + 1, c)) for every
   coordinate c of the other axes. Stage programs stay free of pp collectives, so every stage's
   NEFF is independent of its neighbours' shapes and the same HLO runs on every micro-batch. The
   ranks of both stages run the transfer: the sender passes its tensor, the receiver a buffer of
   the same shape (its contents are ignored; a replica that is no target receives zeros in XLA's
   semantics). A parameter held by two stages (GPT's LM head tied to the embedding) has one more
   HLO, `<model>.tied.<weight>`: a collective-permute both ways between the holders plus an add
   (own + received, equal bits on both sides since float addition commutes), Megatron's
   embedding-group all-reduce written as a 2-rank exchange.
4. manifest: the existing manifest (format_version 1, every field kept) plus a `pipeline`
   section: stage -> NxD ranks and programs, rank -> stages and programs, the transfers with
   their tensors (sender output / receiver input names), pairs and participants, and the order a
   runtime runs them in. `spmd.program_of_rank` names each rank's first program (its stage's
   forward), as before a single string per rank.
5. `run_pipeline_stand_in` runs the written HLO on XLA:CPU in schedule order as `run_stages`
   does (micro-batch by micro-batch: every forward, then every backward, then the tied sums and
   the updates). A stage HLO with collectives runs as a replicated program on world-size XLA:CPU
   devices: XLA:CPU runs one program on every replica, so replicas of the other stages run the
   same stage program on copies of that stage's inputs (its groups never leave a stage, so the
   copies do not interact) and the stage's own replicas' outputs are kept. On Trainium each rank
   loads only its own stage's NEFFs. Transfers run on world-size replicas too.

`portable.lower(step, "neuron:<variant>", DIR)` of such a step goes through here (backend.py):
the payload is a `PipelineLowered` (its `source` is the `PipelineNeuron`), written in the usual
layout (programs/<key>/ per stage program and transfer), and `portable check` of the folder
re-validates every one of them (zero errors for GPT at PP=4 and PP=4 x TP=2). Only the forward,
backward and update programs are lowered: 1f1b and gpipe orders need nothing else; zero-bubble's
backward_input / backward_weight split is not lowered yet (the stand-in runs the same sums).

Only Trainium settles: that neuronx-cc accepts cross-replica collective-permutes in a NEFF that
holds nothing else (and the 2-rank exchange of the tied gradient), that the runtime runs a
transfer NEFF on exactly the ranks of its pairs while other ranks run other NEFFs, the NxD
runtime's ordering of these NEFFs under a real 1f1b schedule, and speed.

What the runtime does outside the HLO (documented, not lowered): summing a stage's parameter
gradients over micro-batches (as `run_stages`, in micro-batch order), the loss summed over
micro-batches on the last stage, and feeding the updated state back to the aliased inputs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from portable.capture import capture
from portable.distributed.launch import per_rank_program, pipeline_free
from portable.errors import BackendError, PlanError
from portable.ir.plan import Mesh
from portable.ir.program import Program
from portable.ir.sharding import coords_of, shard, unshard
from portable.passes.pipeline_split import PipelineStages, StagePrograms, split_stages

from ..base import Lowered, Target
from .artifact import NeuronLowered, NeuronProgram, program_key
from .collectives import RankLayout
from .command import neuronx_cc_argv
from .findings import Severity
from .hlo import parse_hlo_text, proto_from_text, proto_to_text
from .iospec import io_spec
from .memory import estimate_memory
from .options import NeuronOptions
from .targets import DEFAULT_VARIANT, NeuronTarget, resolve_target
from .validate import check_findings, validate

__all__ = [
    "PARTS",
    "PipelineLowered",
    "PipelineNeuron",
    "Transfer",
    "lower_pipeline",
    "run_pipeline_stand_in",
]

PARTS = ("forward", "backward", "update")  # the stage programs lowered (1f1b / gpipe schedules)

_HLO_TYPE = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int32: "s32",
    torch.int64: "s64",
    torch.bool: "pred",
}


@dataclasses.dataclass(frozen=True)
class PipelineLowered(NeuronLowered):
    """A neuron lowering of a pipelined step: every stage and transfer program, and the
    manifest's `pipeline` section."""

    pipeline: dict[str, Any] | None = None
    source: Any = dataclasses.field(default=None, compare=False, repr=False)  # PipelineNeuron


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One transfer HLO: `sends[k]` (an output of `from_stage`'s program) arrives as
    `receives[k]` (an input of `to_stage`'s); `pairs` are (source, target) NxD ranks."""

    kind: str  # "activation", "gradient" or "tied_gradient"
    from_stage: int
    to_stage: int
    sends: tuple[str, ...]
    receives: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    record: NeuronProgram


@dataclasses.dataclass
class PipelineNeuron:
    """What `lower_pipeline` produced: the stages, their HLO records, the transfers, the rank
    layout of the full mesh, and the `Lowered` the backend writes."""

    step: Program
    per_rank: Program
    stages: PipelineStages
    layout: RankLayout
    others: Mesh | None  # the mesh of the axes other than pp (None for PP alone)
    programs: dict[tuple[int, str], NeuronProgram]
    transfers: list[Transfer]
    lowered: Lowered

    def ranks_of_stage(self, stage: int) -> list[int]:
        return _stage_ranks(self.layout, self.stages, self.others, stage)


def _other_coords(others: Mesh | None) -> list[dict[str, int]]:
    if others is None:
        return [{}]
    return [coords_of(others, r) for r in range(others.size)]


def _stage_ranks(
    layout: RankLayout, stages: PipelineStages, others: Mesh | None, stage: int
) -> list[int]:
    axis = stages.pipeline.axis
    return sorted(layout.nxd_rank({**c, axis: stage % stages.ranks}) for c in _other_coords(others))


def lower_pipeline(
    step: Program,
    target: Target | str = DEFAULT_VARIANT,
    options: NeuronOptions | None = None,
    *,
    backend: Any,
) -> PipelineNeuron:
    """Lower the pipelined training step `step` for `neuron:<variant>` (module docstring);
    PlanError (with a fix) for a plan this cannot lower; validator errors raise."""
    plan = step.plan
    if plan.pipeline is None or plan.mesh is None:
        raise PlanError(
            "lower_pipeline needs a training step whose plan has a pipeline",
            fix="Plan(Mesh({'pp': 4}), pipeline=Pipeline(microbatches=...))",
        )
    if isinstance(target, str):
        target = Target("neuron", target.removeprefix("neuron:") or DEFAULT_VARIANT)
    options = options or NeuronOptions()
    ntarget = resolve_target(target.variant or DEFAULT_VARIANT, options.topology)
    layout = RankLayout.of(plan.mesh, ntarget)
    axis = plan.pipeline.axis
    if layout.role(axis) != "PP":
        raise PlanError(
            f"the pipeline runs over mesh axis {axis!r}, which has NxD role "
            f"{layout.role(axis)}, not PP",
            fix="name the pipeline axis 'pp' (Pipeline(axis='pp') and Mesh({'pp': ...}))",
        )
    per_rank = per_rank_program(step)
    stages = split_stages(per_rank)
    others = pipeline_free(plan).mesh
    others = others if others is not None and others.size > 1 else None
    target = Target("neuron", ntarget.name)

    def ranks(stage: int) -> list[int]:
        return _stage_ranks(layout, stages, others, stage)

    programs: dict[tuple[int, str], NeuronProgram] = {}
    for stage in stages.stages:
        for part in PARTS:
            record = backend.lower_with_layout(getattr(stage, part), target, layout)
            programs[stage.index, part] = dataclasses.replace(
                record, ranks=tuple(ranks(stage.index))
            )
    transfers = _transfers(step, stages, layout, others, ntarget, options)
    records = tuple(programs.values()) + tuple(t.record for t in transfers)
    section = _manifest_section(stages, layout, others, programs, transfers)
    payload = PipelineLowered(ntarget, options, records, layout, section)
    first = records[0]
    texts = {"graph.hlo.txt": first.hlo_text, "graph.stablehlo.mlir": first.stablehlo}
    lowered = Lowered(step, Target("neuron", ntarget.name), texts=texts, payload=payload)
    result = PipelineNeuron(step, per_rank, stages, layout, others, programs, transfers, lowered)
    object.__setattr__(payload, "source", result)  # the stand-in runs what was written
    return result


# --- transfers -----------------------------------------------------------------------------


def _outputs(program: Program) -> dict[str, Any]:
    return {o.name: o.spec for o in program.signature.outputs}


def _transfers(
    step: Program,
    stages: PipelineStages,
    layout: RankLayout,
    others: Mesh | None,
    ntarget: NeuronTarget,
    options: NeuronOptions,
) -> list[Transfer]:
    axis = stages.pipeline.axis
    coords = _other_coords(others)
    n = len(stages.stages)
    model = step.name.split(".")[0]

    def rank(stage: int, c: dict[str, int]) -> int:
        return layout.nxd_rank({**c, axis: stage % stages.ranks})

    out: list[Transfer] = []
    for s in range(n - 1):
        sender, receiver = stages.stages[s], stages.stages[s + 1]
        fwd = _outputs(sender.forward)
        sends = tuple(sender.sends)
        receives = tuple("act:" + k.removeprefix("out:") for k in sends)
        pairs = tuple((rank(s, c), rank(s + 1, c)) for c in coords)
        specs = [fwd[k] for k in sends]
        key = f"{model}.cut{s}.activation"
        record = _transfer_record(key, specs, pairs, False, layout, ntarget, options)
        out.append(Transfer("activation", s, s + 1, sends, receives, pairs, record))
        grads = tuple(receiver.grads_sent)
        if grads:
            bwd = _outputs(receiver.backward)
            pairs = tuple((rank(s + 1, c), rank(s, c)) for c in coords)
            key = f"{model}.cut{s}.gradient"
            record = _transfer_record(
                key, [bwd[k] for k in grads], pairs, False, layout, ntarget, options
            )
            out.append(Transfer("gradient", s + 1, s, grads, grads, pairs, record))
    for tied in stages.tied:
        if len(tied.stages) != 2:
            raise PlanError(
                f"{tied.target} is held by {len(tied.stages)} stages {list(tied.stages)}; the "
                "neuron pipeline lowering sums a tied gradient between two stages",
                fix="untie the weight or choose split points that place its users on at most "
                "two stages",
            )
        a, b = tied.stages
        spec = _outputs(stages.stages[a].backward)[tied.name]
        pairs = tuple(
            p for c in coords for p in ((rank(a, c), rank(b, c)), (rank(b, c), rank(a, c)))
        )
        key = f"{model}.tied.{tied.target}"
        record = _transfer_record(key, [spec], pairs, True, layout, ntarget, options)
        out.append(
            Transfer("tied_gradient", a, b, (tied.name,), (f"acc:{tied.name}",), pairs, record)
        )
    return out


class _Io(torch.nn.Module):
    """The io of a transfer program (its signature only: the HLO is written by hand)."""

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x * 1 for x in xs)


def _hlo_shape(spec: Any) -> str:
    dtype = _HLO_TYPE.get(spec.dtype)
    if dtype is None or not all(isinstance(d, int) for d in spec.shape):
        raise PlanError(
            f"a pipeline transfer of {spec.dtype} {list(spec.shape)} has no static HLO type",
            fix="send float32 / bfloat16 / integer activations of static shape between stages",
        )
    return f"{dtype}[{','.join(str(d) for d in spec.shape)}]"


def transfer_hlo_text(
    name: str, specs: Sequence[Any], pairs: Sequence[tuple[int, int]], add: bool
) -> str:
    """HLO text of one transfer: a collective-permute per tensor (plus the own value with
    `add`, the tied-gradient exchange), tuple root."""
    safe = re.sub(r"\W", "_", name)
    pairs_text = "{" + ",".join(f"{{{a},{b}}}" for a, b in pairs) + "}"
    shapes = [_hlo_shape(s) for s in specs]
    lines, roots = [], []
    for k, shape in enumerate(shapes):
        lines.append(f"  %p{k} = {shape} parameter({k})")
        lines.append(
            f"  %permute{k} = {shape} collective-permute(%p{k}), source_target_pairs={pairs_text}"
        )
        if add:
            lines.append(f"  %sum{k} = {shape} add(%p{k}, %permute{k})")
        roots.append(f"%sum{k}" if add else f"%permute{k}")
    params = ", ".join(f"p{k}: {s}" for k, s in enumerate(shapes))
    result = "(" + ", ".join(shapes) + ")"
    return (
        f"HloModule {safe}\n\nENTRY %main ({params}) -> {result} {{\n"
        + "\n".join(lines)
        + f"\n  ROOT %out = {result} tuple({', '.join(roots)})\n}}\n"
    )


def _transfer_record(
    key: str,
    specs: Sequence[Any],
    pairs: Sequence[tuple[int, int]],
    add: bool,
    layout: RankLayout,
    ntarget: NeuronTarget,
    options: NeuronOptions,
) -> NeuronProgram:
    examples = tuple(torch.zeros(tuple(s.shape), dtype=s.dtype) for s in specs)
    program = capture(_Io(), examples, name=key)
    proto = proto_from_text(transfer_hlo_text(key, specs, pairs, add))
    text = proto_to_text(proto)
    module = parse_hlo_text(text)
    findings = validate(module, ntarget, options, ranks=layout)
    check_findings(findings, program=key, target=f"neuron:{ntarget.name}")
    stablehlo = _stablehlo_text(proto)
    participants = sorted({r for p in pairs for r in p})
    return NeuronProgram(
        key=program_key(program),
        program=program,
        hlo=proto,
        hlo_text=text,
        stablehlo=stablehlo,
        module=module,
        argv=tuple(neuronx_cc_argv(ntarget, options, program.kind)),
        io_spec=io_spec(program, module),
        memory=estimate_memory(program, module, ntarget),
        findings=tuple(f for f in findings if f.severity is not Severity.ERROR),
        ranks=tuple(participants),
        collectives=(
            {
                "op": "collective_permute",
                "axis": _pp_axis(layout),
                "source_target_pairs": [list(p) for p in pairs],
            },
        ),
    )


def _stablehlo_text(proto: bytes) -> str:
    """StableHLO text of a serialized HloModuleProto (the secondary artifact)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client
    from jax._src.lib.mlir import ir

    bytecode = xla_client._xla.mlir.hlo_to_stablehlo(proto)
    with mlir.make_ir_context():
        return str(ir.Module.parse(bytecode))


def _pp_axis(layout: RankLayout) -> str:
    return next(a for a in layout.order if layout.role(a) == "PP")


# --- manifest --------------------------------------------------------------------------------


def _manifest_section(
    stages: PipelineStages,
    layout: RankLayout,
    others: Mesh | None,
    programs: dict[tuple[int, str], NeuronProgram],
    transfers: list[Transfer],
) -> dict[str, Any]:
    world = layout.world_size
    stage_list = []
    stages_of_rank: list[list[int]] = [[] for _ in range(world)]
    programs_of_rank: list[list[str]] = [[] for _ in range(world)]
    for stage in stages.stages:
        ranks = _stage_ranks(layout, stages, others, stage.index)
        keys = {part: programs[stage.index, part].key for part in PARTS}
        for r in ranks:
            stages_of_rank[r].append(stage.index)
            programs_of_rank[r] += list(keys.values())
        stage_list.append(
            {
                "index": stage.index,
                "pipeline_rank": stage.index % stages.ranks,
                "ranks": ranks,
                "modules": list(stage.modules),
                "programs": keys,
                "receives": list(stage.receives),
                "sends": list(stage.sends),
                "grads_sent": list(stage.grads_sent),
                "param_grads": dict(zip(stage.param_grads, stage.grad_targets, strict=True)),
            }
        )
    for t in transfers:
        for r in t.record.ranks or ():
            programs_of_rank[r].append(t.record.key)
    return {
        "axis": stages.pipeline.axis,
        "pipeline_ranks": stages.ranks,
        "stages": len(stages.stages),
        "microbatches": stages.microbatches,
        "schedule": stages.pipeline.schedule,
        "virtual_stages": stages.pipeline.virtual_stages,
        "split_points": list(stages.split_points),
        "loss": stages.loss_name,
        "stage_of_rank": stages_of_rank,
        "programs_of_rank": programs_of_rank,
        "stage_programs": stage_list,
        "distinct_programs": "one HLO per stage program (forward, backward, update of every "
        "stage; middle stages are not deduplicated) and one per transfer",
        "transfers": [
            {
                "key": t.record.key,
                "kind": t.kind,
                "from_stage": t.from_stage,
                "to_stage": t.to_stage,
                "tensors": [
                    {"send": s, "receive": r, **_spec_json(i, t.record)}
                    for i, (s, r) in enumerate(zip(t.sends, t.receives, strict=True))
                ],
                "source_target_pairs": [list(p) for p in t.pairs],
                "ranks": list(t.record.ranks or ()),
            }
            for t in transfers
        ],
        "transfer_semantics": "collective-permute, cross-replica (no channel id), pairs of NxD "
        "ranks; the ranks of both stages run the transfer HLO: a sender passes its tensor, a "
        "receiver a buffer of the same shape (ignored) and reads the output; tied_gradient: "
        "both holders pass their summed gradient and get own + received",
        "runtime_order": [
            "per micro-batch i (rows i::M of each batch input): stage 0..n-1 forward, each "
            "followed by its cut's activation transfer",
            "per micro-batch i: stage n-1..0 backward, each followed by its cut's gradient "
            "transfer; each stage sums its parameter gradients over micro-batches in "
            "micro-batch order (the runtime's add: acc:<name> = g0 + g1 + ...)",
            "tied_gradient transfers, then every stage's update (state aliased in place); "
            "the step's loss is the sum of the last stage's micro-batch losses",
        ],
    }


def _spec_json(index: int, record: NeuronProgram) -> dict[str, Any]:
    entry = record.io_spec["inputs"][index]
    return {"shape": entry["shape"], "dtype": entry["dtype"]}


# --- the XLA:CPU stand-in ----------------------------------------------------------------------


class _Replicated:
    """A serialized HloModuleProto compiled for `n` XLA:CPU replicas (one per device)."""

    def __init__(self, proto: bytes, n: int) -> None:
        import jax
        import numpy as np
        from jax._src.lib import xla_client as xc

        devices = jax.devices("cpu")
        if len(devices) < n:
            raise BackendError(
                f"the stand-in runs this pipeline on {n} XLA:CPU devices; JAX has {len(devices)}",
                fix=f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} before JAX is "
                "imported",
            )
        self.devices = devices[:n]
        options = xc.CompileOptions()
        options.num_replicas = n
        options.num_partitions = 1
        options.device_assignment = xc.DeviceAssignment.create(np.arange(n).reshape(n, 1))
        module = xc._xla.mlir.hlo_to_stablehlo(proto)
        client = self.devices[0].client
        self.exe = client.compile_and_load(module, xc.DeviceList(tuple(self.devices)), options)

    def __call__(self, per_replica: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        import jax
        import numpy as np

        from .stand_in import _to_numpy, _to_torch

        n = len(self.devices)
        container = jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(self.devices), ("r",)), jax.sharding.PartitionSpec()
        )
        with jax.enable_x64(True):
            args = []
            for k in range(len(per_replica[0])):
                shards = [
                    jax.device_put(_to_numpy(per_replica[r][k]), self.devices[r]) for r in range(n)
                ]
                args.append(
                    jax.make_array_from_single_device_arrays(shards[0].shape, container, shards)
                )
            outs = self.exe.execute_sharded(args).disassemble_into_single_device_arrays()
        return [[_to_torch(outs[k][r]) for k in range(len(outs))] for r in range(n)]


def _micro(value: torch.Tensor, m: int) -> list[torch.Tensor]:
    return [value[i::m] for i in range(m)]


def run_pipeline_stand_in(
    lowered: PipelineNeuron,
    state: Mapping[str, torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    steps: int = 1,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Run the lowered stage and transfer HLOs on XLA:CPU, `steps` steps on the same global
    `batch` (by input name) from the global `state` (by weight key): (each step's outputs by the
    step's output names, the final global state). Values are sharded over the other axes per
    rank as the per-rank step lays them out, and gathered back at the end."""
    runner = _StandIn(lowered)
    outputs = []
    local = runner.shard_state(state)
    for _ in range(steps):
        outs, local = runner.step(local, batch)
        outputs.append(outs)
    return outputs, runner.gather_state(local, state)


class _StandIn:
    def __init__(self, lowered: PipelineNeuron) -> None:
        self.pl = lowered
        self.stages = lowered.stages
        self.world = lowered.layout.world_size
        self.coords = _other_coords(lowered.others)
        self.compiled: dict[str, _Replicated] = {}
        self.spmd = lowered.per_rank.spmd if lowered.others is not None else None
        self.by_target = {
            s.target: s.name for s in lowered.per_rank.signature.inputs if s.target is not None
        }
        self.by_target.update({s.name: s.name for s in lowered.per_rank.signature.inputs})

    # values per coordinate c of the other axes: list index c (the others' portable rank)
    def _shard(self, key: str, value: torch.Tensor, c: int) -> torch.Tensor:
        if self.spmd is None:
            return value
        name = self.by_target.get(key, key)
        return shard(value, self.spmd.input(name).sharding, self.spmd.mesh, c)

    def shard_state(self, state: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return [
            {k: self._shard(k, v, c) for k, v in state.items()} for c in range(len(self.coords))
        ]

    def gather_state(
        self, local: list[dict[str, torch.Tensor]], state: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if self.spmd is None:
            return dict(local[0])
        out = {}
        for key in state:
            name = self.by_target.get(key, key)
            sharding = self.spmd.input(name).sharding
            out[key] = unshard(
                [local[c][key] for c in range(len(self.coords))], sharding, self.spmd.mesh
            )
        return out

    def _exe(self, record: NeuronProgram, n: int) -> _Replicated:
        if record.key not in self.compiled:
            self.compiled[record.key] = _Replicated(record.hlo, n)
        return self.compiled[record.key]

    def _rank(self, stage: int, c: int) -> int:
        axis = self.stages.pipeline.axis
        return self.pl.layout.nxd_rank({**self.coords[c], axis: stage % self.stages.ranks})

    def _coord_of(self, rank: int) -> int:
        """The others' portable rank of NxD rank `rank`."""
        layout = self.pl.layout
        if self.pl.others is None:
            return 0
        values = {a: layout.coordinate_of(rank, a) for a in self.pl.others.names}
        return self.coords.index(values)

    def run_stage(
        self, stage: StagePrograms, part: str, envs: list[dict[str, torch.Tensor]]
    ) -> list[dict[str, torch.Tensor]]:
        """`part` of `stage` on every coordinate's env (list per coordinate): outputs by name."""
        program = getattr(stage, part)
        record = self.pl.programs[stage.index, part]
        labels = program.metadata["pipeline"]["inputs"]
        names = [i["name"] for i in record.io_spec["inputs"] if i["role"] != "rank"]
        outs_names = [o.name for o in program.signature.outputs]

        def args(c: int, rank: int) -> list[torch.Tensor]:
            row = [envs[c][labels[n]] for n in names]
            if record.rank_parameter is not None:
                row.append(torch.tensor(rank, dtype=torch.int32))
            return row

        if not record.collectives and record.rank_parameter is None:
            exe = self._exe(record, 1)
            results = [exe([args(c, 0)])[0] for c in range(len(self.coords))]
        else:  # every replica runs this stage's program (module docstring, 5)
            exe = self._exe(record, self.world)
            rows = [args(self._coord_of(r), r) for r in range(self.world)]
            got = exe(rows)
            results = [got[self._rank(stage.index, c)] for c in range(len(self.coords))]
        return [dict(zip(outs_names, r, strict=True)) for r in results]

    def transfer(self, t: Transfer, values: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Run transfer `t`: values[c] = the sender's tensors at coordinate c; the receiver's
        (or for a tied gradient the holders' sums) per coordinate."""
        exe = self._exe(t.record, self.world)
        senders = {self._rank(t.from_stage, c): c for c in range(len(self.coords))}
        rows = []
        for r in range(self.world):
            c = self._coord_of(r)
            if r in senders:
                rows.append(values[c])
            else:
                rows.append([torch.zeros_like(v) for v in values[c]])
        got = exe(rows)
        return [got[self._rank(t.to_stage, c)] for c in range(len(self.coords))]

    def step(
        self, local: list[dict[str, torch.Tensor]], batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        st, m = self.stages, self.stages.microbatches
        n = len(st.stages)
        cs = range(len(self.coords))
        spmd = self.spmd
        micro = []
        for c in cs:
            shards = {k: self._shard(k, v, c) if spmd is not None else v for k, v in batch.items()}
            micro.append({k: _micro(v, m) for k, v in shards.items()})
        act = {t.from_stage: t for t in self.pl.transfers if t.kind == "activation"}
        grad = {t.from_stage: t for t in self.pl.transfers if t.kind == "gradient"}
        saved: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
        losses = []
        for i in range(m):
            carried: list[dict[str, torch.Tensor]] = [{} for _ in cs]
            for stage in st.stages:
                envs = [
                    {**local[c], **{k: v[i] for k, v in micro[c].items()}, **carried[c]} for c in cs
                ]
                outs = self.run_stage(stage, "forward", envs)
                saved[stage.index, i] = outs
                if stage.index == n - 1:
                    losses.append(outs[0][st.loss_name])
                    continue
                t = act[stage.index]
                got = self.transfer(t, [[outs[c][k] for k in t.sends] for c in cs])
                carried = [dict(zip(t.receives, got[c], strict=True)) for c in cs]
        summed: list[dict[tuple[int, str], torch.Tensor]] = [{} for _ in cs]
        for i in range(m):
            grads: list[dict[str, torch.Tensor]] = [{} for _ in cs]
            for stage in reversed(st.stages):
                envs = [
                    {
                        **local[c],
                        **{k: v[i] for k, v in micro[c].items()},
                        **saved[stage.index, i][c],
                        **grads[c],
                    }
                    for c in cs
                ]
                outs = self.run_stage(stage, "backward", envs)
                for c in cs:
                    for name in stage.param_grads:
                        key = (stage.index, name)
                        prev = summed[c].get(key)
                        summed[c][key] = outs[c][name] if prev is None else prev + outs[c][name]
                if stage.index in grad:
                    t = grad[stage.index]
                    got = self.transfer(t, [[outs[c][k] for k in t.sends] for c in cs])
                    grads = [dict(zip(t.receives, got[c], strict=True)) for c in cs]
        for t in self.pl.transfers:
            if t.kind != "tied_gradient":
                continue
            (name,) = t.sends
            a, b = t.from_stage, t.to_stage
            # both holders pass their part; each gets own + received
            exe = self._exe(t.record, self.world)
            rows = []
            for r in range(self.world):
                c = self._coord_of(r)
                s = a if r in {self._rank(a, k) for k in cs} else b
                rows.append([summed[c].get((s, name), summed[c][a, name])])
            got = exe(rows)
            for c in cs:
                summed[c][a, name] = got[self._rank(a, c)][0]
                summed[c][b, name] = got[self._rank(b, c)][0]
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss
        outputs: dict[str, torch.Tensor] = {st.loss_name: total}
        updated = [dict(local[c]) for c in cs]
        per_coord: list[dict[str, torch.Tensor]] = [{} for _ in cs]
        for stage in st.stages:
            envs = [
                {**local[c], **{f"acc:{k}": summed[c][stage.index, k] for k in stage.param_grads}}
                for c in cs
            ]
            outs = self.run_stage(stage, "update", envs)
            for c in cs:
                for k, v in outs[c].items():
                    per_coord[c].setdefault(k, v)
        for out in st.outputs:
            if out.name == st.loss_name:
                continue
            if out.aliases is not None and out.target is not None:
                for c in cs:
                    updated[c][out.target] = per_coord[c][out.name]
            outputs[out.name] = per_coord[0][out.name]
        return outputs, updated
