"""Pipelined training steps on XLA host devices: the stages of `split_stages` as ONE jitted SPMD
program under `jax.shard_map` over the plan's mesh (its axes in mesh order).

Contract: `run_pipeline_xla(stages, state, batch, steps, step)` runs `steps` steps (the same
global batch each) on the mesh's XLA devices and returns (each step's outputs by the step's
output names, the final state by weight key), GLOBAL, as `run_stages` (passes/pipeline_split.py)
and the single-device step with the same accumulation compute them (micro-batch i = rows i::M).
`portable.compile(step, backend="xla")` of a training step whose plan has a pipeline gives a
`PipelineExecutable` (global batch in, StepResult out, `exe.state` global).

- other axes (`pipeline_program`): over a mesh with axes besides the pipeline's (pp x dp x tp,
  tensor-parallel rules, batch axes) the step is first partitioned by spmd-partition over them
  (`pipeline_free(plan)`), then cut, as torch.distributed runs it
  (`distributed.launch.per_rank_program`). The stage programs then have LOCAL shapes (the
  per-rank layout `step.spmd` over the other axes) and hold portable collectives over those axes
  (tensor-parallel all-reduces in forward and backward, data-parallel gradient all-reduces in the
  update); they are traced with the collectives bound to the named mesh axes
  (`NamedAxisCollectives`: psum, all_gather, ... over dp / tp). Device k is rank k of the whole
  mesh (row-major): pipeline rank = its pp coordinate, its rank over the other axes = the rest.
  The devices of one pipeline rank follow the same table entry, so the collectives of a stage
  program run on all members of each dp / tp group together. A plan with an fsdp_axis is refused
  (PlanError).
- placement: stage s on pipeline rank s % P (interleaved, as torch.distributed.pipelining places
  virtual stages). A device's state (its stages' weights and optimizer state, its LOCAL shards
  over the other axes: `shard` by the per-rank layout's `Sharding`s; a weight two of its stages
  share, once) is one flat buffer per dtype; the devices' buffers form a (devices, width) array
  sharded over all mesh axes, donated and kept on the devices from step to step. The global
  batch is laid out by the per-rank layout (split over dp, replicated over pp and tp; replicated
  everywhere over a mesh of the pipeline axis alone); results are `unshard`ed from the devices
  of the pipeline rank holding them.
- timetable (`rank_order`, `timetable`): each rank works in the schedule's order: gpipe (all
  forwards, then all backwards), 1f1b (P - r - 1 warm-up forwards, then one forward one
  backward), interleaved-1f1b (Megatron's order over the virtual stages, rounds of P
  micro-batches), zero-bubble (that order with each backward split into its input-gradient part,
  which the previous stage waits for, and its weight-gradient part, run in the rank's next idle
  tick: ZB-H1's filling, the same sums as 1f1b). Work is placed in ticks statically (an action
  runs once what it reads was sent in an earlier tick); the tables are program constants indexed
  by tick and `axis_index`.
- a tick (`lax.scan` over the ticks): each device `lax.switch`es to its table entry's stage
  program (lowering.jax_function) or idles; then activations move one rank forward and their
  gradients one back by `lax.ppermute` over the pipeline axis only (collective-permute; a ring
  when V > 1). Received values, residuals and stashes wait in a row per (local stage,
  micro-batch): memory for all M micro-batches, not 1f1b's P in flight. Every device's
  executable holds every stage's code.
- sums: a stage's backwards run in micro-batch order under every schedule here, so gradients are
  summed from zero in micro-batch order as the step's ((g0 + g1) + g2) ..., the loss likewise on
  the last stage. A tied gradient's parts are all-gathered over the pipeline axis and summed in
  stage order by each holder (not a psum, whose order is XLA's).
- update: each device `lax.switch`es on its rank to its stages' update programs (state from
  before the step, the summed gradients); metrics and the loss come back in per-device output
  buffers, read from the stage that owns them (`stages.owner`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from portable.distributed.launch import per_rank_program
from portable.errors import BackendError, InputError, PlanError
from portable.ir.plan import Mesh
from portable.ir.program import Program
from portable.ir.sharding import Sharding, coords_of, rank_of, shard, unshard
from portable.ir.signature import InputKind, OutputSpec, TensorSpec
from portable.passes.pipeline_split import PipelineStages, split_stages
from portable.runtime import Executable

from .compiler import compile_lowered, row_major
from .dtypes import to_jax
from .lowering import jax_function
from .rules.portable_ops import NamedAxisCollectives
from .spmd import jax_mesh, partition_spec, to_torch

__all__ = [
    "PipelineExecutable",
    "PipelineFunction",
    "pipeline_function",
    "pipeline_program",
    "pipeline_stages",
    "rank_order",
    "run_pipeline_xla",
    "timetable",
]

# (kind, stage, micro-batch); kinds: F forward, B backward, I its input part, W its weight part
Action = tuple[str, int, int]
PROGRAM = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
# output-name prefix -> the buffer it goes to; input-label prefix -> the buffer it comes from
WRITES = {"out:": "act", "grad:": "grad", "res:": "res", "stash:": "stash"}
READS = {"act:": "act", "grad:": "grad", "res:": "res", "stash:": "stash"}


def pipeline_program(program: Program) -> Program:
    """The step whose stages run: `program` itself over a mesh of the pipeline axis alone; over
    a mesh with other axes, the per-rank step spmd-partition makes over them, carrying the whole
    plan (as torch.distributed runs it: `distributed.launch.per_rank_program`). PlanError for
    what is not supported here (an FSDP axis)."""
    plan, pipeline = program.plan, program.plan.pipeline
    assert pipeline is not None and plan.mesh is not None  # Plan requires a mesh for a pipeline
    if plan.fsdp_axis is not None:
        raise PlanError(
            f"the xla backend does not run a pipeline with fsdp_axis={plan.fsdp_axis!r}",
            fix="drop fsdp_axis (keep the axis in batch_axes for data parallelism) for a "
            "pipelined step on xla",
        )
    return per_rank_program(program)


def pipeline_stages(program: Program) -> PipelineStages:
    """The stages of a pipelined step (of its per-rank form over the other axes, if any)."""
    return split_stages(pipeline_program(program))


def pipeline_function(program: Program, devices: Sequence[Any] | None = None) -> PipelineFunction:
    """The pipelined step `program` (GLOBAL signature) as a PipelineFunction."""
    step = pipeline_program(program)
    return PipelineFunction(split_stages(step), devices, step)


# --- the timetable ----------------------------------------------------------------------------


def rank_order(schedule: str, ranks: int, virtual: int, m: int, rank: int) -> list[Action]:
    """The forwards and backwards of `rank`, in the order `schedule` runs them."""
    p, v = ranks, virtual
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]

    def unit(kind: str, k: int) -> Action:
        chunk = (k // p) % v
        chunk = v - 1 - chunk if kind == "B" else chunk
        return (kind, chunk * p + rank, (k // (p * v)) * p + k % p if v > 1 else k)

    n = m * v
    warmup = min(n, p - rank - 1 if v == 1 else 2 * (p - rank - 1) + (v - 1) * p)
    order = [unit("F", k) for k in range(warmup)]
    for k in range(n - warmup):
        order += [unit("F", warmup + k), unit("B", k)]
    return order + [unit("B", k) for k in range(n - warmup, n)]


def timetable(
    orders: Sequence[Sequence[Action]], n_stages: int, zero_bubble: bool = False
) -> list[list[Action | None]]:
    """Ticks x ranks: each rank runs its next action once its inputs were sent in an earlier
    tick; with `zero_bubble` a backward runs as "I" and its "W" in the rank's next idle tick."""
    done: dict[Action, int] = {}
    position = [0] * len(orders)
    deferred: list[collections.deque[Action]] = [collections.deque() for _ in orders]
    ticks: list[list[Action | None]] = []
    back = "I" if zero_bubble else "B"

    def ready(kind: str, s: int, i: int, t: int) -> bool:
        if kind == "F":
            return s == 0 or done.get(("F", s - 1, i), t) < t
        last = s == n_stages - 1
        return done.get(("F", s, i), t) < t and (last or done.get((back, s + 1, i), t) < t)

    while any(p < len(o) for p, o in zip(position, orders, strict=True)) or any(deferred):
        t = len(ticks)
        if t > 4 * sum(len(o) for o in orders) + 8:
            raise BackendError(
                "the pipeline timetable does not progress (a schedule waiting on itself)",
                fix="report this with the plan; use schedule='1f1b' meanwhile",
            )
        row: list[Action | None] = []
        for r, order in enumerate(orders):
            action: Action | None = None
            if position[r] < len(order) and ready(*order[position[r]], t):
                kind, s, i = order[position[r]]
                position[r] += 1
                if zero_bubble and kind == "B":
                    deferred[r].append(("W", s, i))
                action = (back if kind == "B" else kind, s, i)
            elif deferred[r]:
                action = deferred[r].popleft()
            row.append(action)
        done.update({a: t for a in row if a is not None})
        ticks.append(row)
    return ticks


# --- flat buffers -----------------------------------------------------------------------------


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _jax_dtype(d: str) -> Any:
    return to_jax(getattr(torch, d))


@dataclasses.dataclass
class _Layout:
    """Named tensors packed into one flat vector per dtype (keyed by the dtype's name)."""

    slots: dict[str, tuple[str, int, tuple[int, ...]]]  # name -> (dtype, offset, shape)
    sizes: dict[str, int]

    @staticmethod
    def of(items: Iterable[tuple[str, TensorSpec]]) -> _Layout:
        slots: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        sizes: dict[str, int] = {}
        for name, spec in items:
            if name not in slots:
                shape, d = tuple(int(n) for n in spec.shape), _name(spec.dtype)
                slots[name] = (d, sizes.get(d, 0), shape)
                sizes[d] = sizes.get(d, 0) + math.prod(shape)
        return _Layout(slots, sizes)

    @staticmethod
    def prefixed(outputs: Iterable[OutputSpec], prefix: str) -> _Layout:
        return _Layout.of(
            (o.name[len(prefix) :], o.spec) for o in outputs if o.name.startswith(prefix)
        )

    def get(self, flats: Mapping[str, Any], name: str) -> Any:
        d, offset, shape = self.slots[name]
        return flats[d][offset : offset + math.prod(shape)].reshape(shape)

    def pack(self, values: Mapping[str, Any], widths: Mapping[str, int]) -> dict[str, Any]:
        """The values (zeros where absent) as flat jax vectors of `widths`."""
        parts: dict[str, list[Any]] = {d: [] for d in widths}
        for name, (d, _, shape) in self.slots.items():
            value = values.get(name)
            flat = jnp.zeros(math.prod(shape)) if value is None else value.reshape(-1)
            parts[d].append(flat.astype(_jax_dtype(d)))
        for d, width in widths.items():
            parts[d].append(jnp.zeros(width - self.sizes.get(d, 0), _jax_dtype(d)))
        return {d: jnp.concatenate(p) for d, p in parts.items()}


def _widths(layouts: Iterable[_Layout]) -> dict[str, int]:
    widths: dict[str, int] = {}
    for layout in layouts:
        for d, n in layout.sizes.items():
            widths[d] = max(widths.get(d, 0), n)
    return dict(sorted(widths.items()))


def _row(buf: Any, slot: Any) -> Any:
    return lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)


def _put_row(buf: Any, row: Any, slot: Any) -> Any:
    return lax.dynamic_update_slice(buf, row[None], (slot, slot * 0))  # int32 indices


# --- the SPMD program -------------------------------------------------------------------------


class PipelineFunction:
    """The stages as one jitted shard_map over P devices: (state buffers, global batch) ->
    (updated state buffers, output buffers); `run` is the torch-facing form."""

    def __init__(
        self,
        stages: PipelineStages,
        devices: Sequence[Any] | None = None,
        step: Program | None = None,
    ) -> None:
        self.stages, self.p, self.n = stages, stages.ranks, len(stages.stages)
        self.v, self.m, self.axis = self.n // self.p, stages.microbatches, stages.pipeline.axis
        self.zero_bubble = stages.pipeline.schedule == "zero-bubble"
        # `step`: the per-rank step over the other axes the stages were cut from (its layout
        # shards state and batch), or None (or the step itself) over the pipeline axis alone
        self.layout = step.spmd if step is not None and step.is_per_rank else None
        self.full = Mesh({self.axis: self.p})
        self._state_sharding: dict[str, Sharding] = {}
        self._output_sharding: dict[str, Sharding] = {}
        if step is not None and self.layout is not None:
            assert step.plan.mesh is not None
            self.full = step.plan.mesh
            for i in step.signature.state_inputs:
                self._state_sharding[i.key] = self.layout.input(i.name).sharding
            for o in step.signature.outputs:
                self._output_sharding[o.name] = self.layout.output(o.name).sharding
        self.mesh = jax_mesh(self.full, devices)
        # device k (rank k of the whole mesh): its pipeline rank and its rank over the others
        coords = [coords_of(self.full, k) for k in range(self.full.size)]
        self.pp_of = [c[self.axis] for c in coords]
        sub = self.layout.mesh if self.layout is not None else Mesh({})
        self.sub_of = [rank_of(sub, {a: c[a] for a in sub.names}) for c in coords]
        self.outputs = {o.name: o for o in stages.outputs}
        kinds = ("F", "I", "W") if self.zero_bubble else ("F", "B")
        parts = [PROGRAM[k] for k in kinds] + ["update"]
        self.programs = {(st.index, k): getattr(st, k) for st in stages.stages for k in parts}
        collectives = NamedAxisCollectives() if self.layout is not None else None
        self.fns = {
            key: jax_function(prog, "xla", collectives) for key, prog in self.programs.items()
        }
        spec: dict[str, TensorSpec] = {}  # input label / output name -> its spec
        for prog in self.programs.values():
            labels = prog.metadata["pipeline"]["inputs"]
            spec.update({labels[i.name]: i.spec for i in prog.signature.inputs})
            spec.update({o.name: o.spec for o in prog.signature.outputs})
        self.batch_names = [n for n in stages.batch_inputs if n in spec]
        self.batch_specs = [spec[n] for n in self.batch_names]
        # per rank: its state, its gradient sums, its tied gradients' parts, its outputs
        self.state, self.acc, self.tied, self.out = [], [], [], []
        tied = {t.name for t in stages.tied}
        self.home: dict[str, int] = {}  # weight key -> the rank whose copy the result reads
        for r in range(self.p):
            local = stages.stages_of_rank(r)
            updates = [
                (st, self.outputs[o.name]) for st in local for o in st.update.signature.outputs
            ]
            keys = [k for st in local for k in st.state]
            keys += [o.key for _, o in updates if o.aliases and o.target]
            self.state.append(_Layout.of((k, spec[k]) for k in keys))
            for k in keys:
                self.home.setdefault(k, r)
            grads = [(f"{st.index}:{g}", spec[g]) for st in local for g in st.param_grads]
            self.acc.append(_Layout.of(grads))
            self.tied.append(_Layout.of(g for g in grads if g[0].split(":", 1)[1] in tied))
            outs = [(o.name, o.spec) for st, o in updates if stages.owner[o.name] == st.index]
            outs = [o for o in outs if not self.outputs[o[0]].aliases]
            if (self.n - 1) % self.p == r:
                outs.append((stages.loss_name, spec[stages.loss_name]))
            self.out.append(_Layout.of(outs))
        for out in stages.outputs:
            if out.aliases and out.target:
                self.home[out.key] = stages.owner[out.name] % self.p
        # per stage: the rows it writes into each buffer (what it sends, keeps, stashes)
        self.writes: dict[str, list[_Layout]] = {buf: [] for buf in WRITES.values()}
        for st in stages.stages:
            made = [o for k in kinds for o in self.programs[st.index, PROGRAM[k]].signature.outputs]
            for prefix, buf in WRITES.items():
                self.writes[buf].append(_Layout.prefixed(made, prefix))
        self.widths = {buf: _widths(rows) for buf, rows in self.writes.items()}
        for name in ("state", "acc", "tied", "out"):
            self.widths[name] = _widths(getattr(self, name))
        self.loss_dtype = _jax_dtype(_name(spec[stages.loss_name].dtype))
        self.ticks = timetable(
            [
                rank_order(stages.pipeline.schedule, self.p, self.v, self.m, r)
                for r in range(self.p)
            ],
            self.n,
            self.zero_bubble,
        )
        self.branch_of = {
            (k, s): 1 + j * self.n + s for j, k in enumerate(kinds) for s in range(self.n)
        }
        self.table = self._table()
        rows = P(self.full.names)  # one row per device, rank-major over the whole mesh
        self.sharded = NamedSharding(self.mesh, rows)
        batch_specs = tuple(self._batch_spec(n) for n in self.batch_names)
        self.batch_shardings = [NamedSharding(self.mesh, s) for s in batch_specs]
        body = jax.shard_map(
            self._body,
            mesh=self.mesh,
            in_specs=(rows, batch_specs),
            out_specs=(rows, rows),
            check_vma=False,  # the tables make each device's work its own; nothing is replicated
        )
        state_args = {
            d: jax.ShapeDtypeStruct((self.full.size, w), _jax_dtype(d), sharding=self.sharded)
            for d, w in self.widths["state"].items()
        }
        batch_args = tuple(
            jax.ShapeDtypeStruct(self._global(n, s), _jax_dtype(_name(s.dtype)), sharding=sh)
            for n, s, sh in zip(
                self.batch_names, self.batch_specs, self.batch_shardings, strict=True
            )
        )
        with jax.enable_x64(True):
            self.lowered = jax.jit(body, donate_argnums=(0,)).lower(state_args, batch_args)
            self.compiled = compile_lowered(self.lowered)

    def _global(self, name: str, spec: TensorSpec) -> tuple[int, ...]:
        """The global shape of batch input `name` (its stage programs read a micro-batch)."""
        if self.layout is not None:
            return tuple(int(d) for d in self.layout.input(name).global_shape)
        return (int(spec.shape[0]) * self.m, *(int(d) for d in spec.shape[1:]))

    def _batch_spec(self, name: str) -> Any:
        if self.layout is None:
            return P()
        return partition_spec(self.layout.input(name).sharding)

    def _sharding(self, key: str, *, output: bool = False) -> Sharding | None:
        """The per-rank layout's Sharding of a state tensor (by weight key) or an output."""
        if self.layout is None:
            return None
        return self._output_sharding[key] if output else self._state_sharding[key]

    def _devices_of(self, r: int) -> list[int]:
        """The devices of pipeline rank r, in rank order over the other axes."""
        return sorted(
            (k for k in range(self.full.size) if self.pp_of[k] == r), key=self.sub_of.__getitem__
        )

    def _local(self, value: torch.Tensor, sharding: Sharding | None, k: int) -> torch.Tensor:
        if sharding is None or self.layout is None:
            return value
        return shard(value, sharding, self.layout.mesh, self.sub_of[k])

    def _global_value(self, parts: list[torch.Tensor], sharding: Sharding | None) -> torch.Tensor:
        if sharding is None or self.layout is None:
            return parts[0]
        return unshard(parts, sharding, self.layout.mesh)

    def _table(self) -> Any:
        """(ticks, 4, P) int32: per tick and rank the branch, the micro-batch, and the mailbox
        rows the activation and the gradient received at the end of the tick go to."""
        p, m = self.p, self.m
        table = np.zeros((len(self.ticks), 4, p), np.int32)
        table[:, 2:, :] = self.v * m  # the mailbox row nothing is received into
        for t, row in enumerate(self.ticks):
            for r, action in enumerate(row):
                if action is None:
                    continue
                kind, s, i = action
                table[t, :2, r] = self.branch_of[kind, s], i
                if kind == "F" and s + 1 < self.n:
                    table[t, 2, (r + 1) % p] = ((s + 1) // p) * m + i
                if kind in ("B", "I") and s > 0:
                    table[t, 3, (r - 1) % p] = ((s - 1) // p) * m + i
        return table

    # -- the per-device body (traced once) ----------------------------------------------------
    def _body(self, state: dict[str, Any], batch: tuple[Any, ...]) -> tuple[dict, dict]:
        w, slots = self.widths, self.v * self.m
        r = lax.axis_index(self.axis)
        state = {d: x[0] for d, x in state.items()}

        def zeros(widths: Mapping[str, int], *rows: int) -> dict[str, Any]:
            return {d: jnp.zeros((*rows, n), _jax_dtype(d)) for d, n in widths.items()}

        carry0 = {
            "acc": zeros(w["acc"]),
            "res": zeros(w["res"], slots),
            "stash": zeros(w["stash"], slots),
            "act": zeros(w["act"], slots + 1),
            "grad": zeros(w["grad"], slots + 1),
            "loss": jnp.zeros((), self.loss_dtype),
        }
        batches = dict(zip(self.batch_names, batch, strict=True))
        branches = [lambda c, i: (c, zeros(w["act"]), zeros(w["grad"]))]  # idle
        for kind, s in sorted(self.branch_of, key=self.branch_of.__getitem__):
            branches.append(self._work(kind, s, state, batches))
        ring = self.v > 1
        forward = [(k, (k + 1) % self.p) for k in range(self.p) if ring or k + 1 < self.p]
        backward = [(k, (k - 1) % self.p) for k in range(self.p) if ring or k > 0]

        def tick(carry: dict, row: Any) -> tuple[dict, None]:
            branch, i, act_row, grad_row = (x[r] for x in row)
            carry, sent, back = lax.switch(branch, branches, carry, i)
            received = {
                "act": (lax.ppermute(sent, self.axis, forward), act_row),
                "grad": (lax.ppermute(back, self.axis, backward), grad_row),
            }
            carry = dict(carry)
            for buf, (value, at) in received.items():
                carry[buf] = {d: _put_row(x, value[d], at) for d, x in carry[buf].items()}
            return carry, None

        carry, _ = lax.scan(tick, carry0, jnp.asarray(self.table))
        parts = lax.switch(
            r, [lambda acc, k=k: self._tied_parts(k, acc) for k in range(self.p)], carry["acc"]
        )
        gathered = {d: lax.all_gather(x, self.axis) for d, x in parts.items()}
        updates = [
            lambda acc, g, loss, k=k: self._update(k, state, acc, g, loss) for k in range(self.p)
        ]
        new_state, outs = lax.switch(r, updates, carry["acc"], gathered, carry["loss"])
        return {d: x[None] for d, x in new_state.items()}, {d: x[None] for d, x in outs.items()}

    def _work(self, kind: str, s: int, state: dict, batches: dict) -> Any:
        """The branch running stage `s`'s `kind` program on micro-batch i: (carry, i) ->
        (carry, the rows it sends forward, the rows it sends back)."""
        program, fn = self.programs[s, PROGRAM[kind]], self.fns[s, PROGRAM[kind]]
        labels = program.metadata["pipeline"]["inputs"]
        held, acc_layout = self.state[s % self.p], self.acc[s % self.p]
        reads = {  # buffer -> the layout of the rows this stage reads from it
            "act": self.writes["act"][s - 1] if s else None,
            "grad": self.writes["grad"][s + 1] if s + 1 < self.n else None,
            "res": self.writes["res"][s],
            "stash": self.writes["stash"][s],
        }

        def branch(carry: dict, i: Any) -> tuple[dict, dict, dict]:
            slot = (s // self.p) * self.m + i
            rows: dict[str, dict[str, Any]] = {}
            args = []
            for spec in program.signature.inputs:
                label = labels[spec.name]
                if label in held.slots:
                    args.append(held.get(state, label))
                elif label in batches:
                    value = batches[label]
                    value = value.reshape(value.shape[0] // self.m, self.m, *value.shape[1:])
                    args.append(lax.dynamic_index_in_dim(value, i, 1, keepdims=False))
                else:
                    prefix, name = label.split(":", 1)
                    buf, layout = READS[prefix + ":"], reads[READS[prefix + ":"]]
                    assert layout is not None, f"{program.name} reads {label}"
                    if buf not in rows:
                        rows[buf] = {d: _row(x, slot) for d, x in carry[buf].items()}
                    args.append(layout.get(rows[buf], name))
            outs = dict(zip((o.name for o in program.signature.outputs), fn(*args), strict=True))
            packed = {
                buf: self.writes[buf][s].pack(
                    {n[len(p) :]: x for n, x in outs.items() if n.startswith(p)}, self.widths[buf]
                )
                for p, buf in WRITES.items()
            }
            carry = dict(carry)
            for buf in ("res", "stash"):
                if self.writes[buf][s].slots:
                    carry[buf] = {
                        d: _put_row(x, packed[buf][d], slot) for d, x in carry[buf].items()
                    }
            if kind in ("B", "W"):  # this micro-batch's gradients join the sums
                acc = dict(carry["acc"])
                for g in self.stages.stages[s].param_grads:
                    d, offset, shape = acc_layout.slots[f"{s}:{g}"]
                    acc[d] = acc[d].at[offset : offset + math.prod(shape)].add(outs[g].reshape(-1))
                carry["acc"] = acc
            if kind == "F" and s == self.n - 1:
                carry["loss"] = carry["loss"] + outs[self.stages.loss_name]
            return carry, packed["act"], packed["grad"]

        return branch

    def _tied_parts(self, r: int, acc: dict) -> dict:
        layout = self.tied[r]
        return layout.pack({n: self.acc[r].get(acc, n) for n in layout.slots}, self.widths["tied"])

    def _update(self, r: int, state: dict, acc: dict, gathered: dict, loss: Any) -> tuple:
        """Rank r's update programs: (its new state buffers, its output buffers)."""
        layout = self.state[r]
        new = {k: layout.get(state, k) for k in layout.slots}
        outs: dict[str, Any] = {}
        tied = {t.name: t.stages for t in self.stages.tied}
        for st in self.stages.stages_of_rank(r):
            program = self.programs[st.index, "update"]
            labels = program.metadata["pipeline"]["inputs"]
            args = []
            for spec in program.signature.inputs:
                label = labels[spec.name]
                g = label.removeprefix("acc:")
                if label in layout.slots:
                    args.append(layout.get(state, label))
                elif g in tied:  # the parts of every holder, summed in stage order
                    at = [(h, {d: x[h % self.p] for d, x in gathered.items()}) for h in tied[g]]
                    parts = [self.tied[h % self.p].get(flats, f"{h}:{g}") for h, flats in at]
                    args.append(functools.reduce(operator.add, parts))
                else:
                    args.append(self.acc[r].get(acc, f"{st.index}:{g}"))
            names = (o.name for o in program.signature.outputs)
            for name, value in zip(names, self.fns[st.index, "update"](*args), strict=True):
                out = self.outputs[name]
                if out.aliases and out.target:
                    new[out.key] = value
                elif self.stages.owner[name] == st.index:
                    outs[name] = value
        if (self.n - 1) % self.p == r:
            outs[self.stages.loss_name] = loss
        return layout.pack(new, self.widths["state"]), self.out[r].pack(outs, self.widths["out"])

    # -- host side ----------------------------------------------------------------------------
    def put(
        self, state: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """GLOBAL state and batch -> (the (devices, width) state buffers, each device's row its
        stages' state (their LOCAL shards over the other axes), the batch laid out by the
        per-rank layout (replicated over a mesh of the pipeline axis alone))."""
        missing = [k for k in self.home if k not in state]
        if missing:
            raise InputError(
                f"the pipelined step needs the state {missing[:4]}", fix="pass every weight key"
            )
        for name, spec in zip(self.batch_names, self.batch_specs, strict=True):
            value, want = batch.get(name), self._global(name, spec)
            if value is None or tuple(value.shape) != want or value.dtype != spec.dtype:
                got = "nothing" if value is None else f"{value.dtype} {list(value.shape)}"
                raise InputError(
                    f"batch input {name!r} of the pipelined step is {spec.dtype} {list(want)}, "
                    f"got {got}",
                    fix=f"pass the global batch: {self.m} micro-batches of {list(spec.shape)} "
                    "per rank",
                )
        with jax.enable_x64(True):
            rows = []
            for k in range(self.full.size):
                layout = self.state[self.pp_of[k]]
                values = {
                    key: jnp.from_dlpack(
                        self._local(state[key].detach(), self._sharding(key), k)
                        .reshape(-1)
                        .contiguous()
                    )
                    for key in layout.slots
                }
                rows.append(layout.pack(values, self.widths["state"]))
            buffers = {
                d: jax.device_put(jnp.stack([row[d] for row in rows]), self.sharded)
                for d in self.widths["state"]
            }
            arrays = tuple(
                jax.device_put(jnp.from_dlpack(row_major(batch[n])), sh, may_alias=False)
                for n, sh in zip(self.batch_names, self.batch_shardings, strict=True)
            )
        return buffers, arrays

    def __call__(self, state: dict[str, Any], batch: tuple[Any, ...]) -> tuple[dict, dict]:
        with jax.enable_x64(True):
            return self.compiled(state, batch)

    def read(self, state: dict[str, Any], outs: dict[str, Any]) -> tuple[dict, dict]:
        """(the step's outputs by name, the state by weight key), GLOBAL, from the device
        buffers (a value over the other axes: its shards on its pipeline rank's devices)."""
        host = {d: to_torch(x) for d, x in state.items()}
        host_outs = {d: to_torch(x) for d, x in outs.items()}

        def value(layout: _Layout, flats: dict, r: int, name: str, sharding: Any) -> torch.Tensor:
            parts = [
                layout.get({d: x[k] for d, x in flats.items()}, name) for k in self._devices_of(r)
            ]
            return self._global_value(parts, sharding)

        values = {
            name: value(layout, host_outs, r, name, self._sharding(name, output=True))
            for r, layout in enumerate(self.out)
            for name in layout.slots
        }
        new_state = {
            k: value(self.state[r], host, r, k, self._sharding(k)) for k, r in self.home.items()
        }
        values.update(
            {o.name: new_state[o.key] for o in self.stages.outputs if o.aliases and o.target}
        )
        return values, new_state

    def run(
        self, state: Mapping[str, torch.Tensor], batch: Mapping[str, torch.Tensor], steps: int = 1
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """`steps` steps on the same batch: (each step's outputs, the final state)."""
        buffers, arrays = self.put(state, batch)
        per_step, final = [], dict(state)
        for _ in range(steps):
            buffers, outs = self(buffers, arrays)
            values, new_state = self.read(buffers, outs)
            per_step.append(values)
            final.update(new_state)
        return per_step, final


def run_pipeline_xla(
    stages: PipelineStages,
    state: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    steps: int = 1,
    step: Program | None = None,
) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """`steps` pipelined steps on the mesh's XLA host devices (the module docstring): (each
    step's outputs by the step's output names, the final state by weight key), GLOBAL. `step`:
    the per-rank step over the other axes the stages were cut from (None: a mesh of the
    pipeline axis alone)."""
    return PipelineFunction(stages, step=step).run(state, batch, steps)


class PipelineExecutable(Executable):
    """`portable.compile(pipelined_step, backend="xla")`: global batch in, StepResult out."""

    def __init__(self, program: Program, backend: str, fn: PipelineFunction) -> None:
        self.fn = fn  # split_stages refused anything but a training step
        super().__init__(program, self._run, backend)

    def _run(self, flat: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        sig = self.program.signature
        state, batch = {}, {}
        for spec, value in zip(sig.inputs, flat, strict=True):
            if spec.kind is InputKind.USER_INPUT:
                batch[spec.name] = value
            else:
                state[spec.key] = value
        outputs, _ = self.fn.run(state, batch, 1)
        return [outputs[0][o.name] for o in sig.outputs]
