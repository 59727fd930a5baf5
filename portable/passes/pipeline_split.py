"""Cut a training step into pipeline stages: per-stage forward, backward and update programs.

The step program of `accumulate=M` (capture/accumulate.py) holds M copies of the joint graph of
one micro-batch, then the optimizer update. Micro-batch 0's copy is the template of every
micro-batch: this pass assigns each of its ops to a stage and cuts it into, per stage,

- `forward`: (the stage's parameters and buffers, its batch inputs' micro-batch, the
  activations received from the previous stage) -> (the activations sent to the next stage, or
  the micro-batch's loss on the last stage; then the residuals its backward reads);
- `backward`: (parameters, buffers, batch inputs, residuals, the gradients of the activations it
  sent) -> (the gradients of the float activations it received; then its parameters' gradients
  for this micro-batch);
- `backward_input` / `backward_weight`: the backward split for zero-bubble schedules: the input
  gradients first (what the previous stage waits for), the weight gradients later from a stash;
- `update`: (parameters, optimizer state, the step counter, the gradients summed over the
  micro-batches) -> updated parameters, updated state and metrics, as the step's own update.

Every program is an ordinary `Program` whose inputs are all user inputs (the engines pass state
explicitly), so every backend runs and lowers it. Stages are cut at module boundaries: explicit
`Pipeline.split_points` (the module paths where stages 1, 2, ... begin) or, without them, the
model's repeated layers (`blocks.0`, `model.layers.0`, ...) balanced by counted FLOPs.

Values that depend on no parameter and no batch input (causal masks, position ids, rotary tables
sliced from buffers, backward seeds) are recomputed by every stage that reads them instead of
being sent. A parameter read by several stages (an LM head tied to the embedding) is held by each
of them; each computes its part of the gradient and the parts are summed across those stages
(`TiedGradient`) before the identical updates, as Megatron all-reduces tied embedding gradients
between the first and last stage. The schedule itself is not this pass's business: engines run
these programs under torch.distributed.pipelining's schedules (portable/distributed/pipeline.py),
and `run_stages` (pipeline_reference.py) runs them in one process in micro-batch order, as
the reference.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
import re
import typing
from collections.abc import Sequence

import torch
import torch.fx

from ..errors import PlanError
from ..ir.plan import Pipeline
from ..ir.program import Program, ProgramKind
from ..ir.signature import InputKind, InputSpec, OutputKind, OutputSpec, Signature, TensorSpec
from ..ir.source import SourceLoc
from ..recipe import recipe_of
from .pipeline_balance import balance, flops, layer_modules, tensor_of
from .pipeline_graph import (
    MICRO_BATCH,
    PHASE,
    ancestors,
    closure_up,
    first_micro_batch,
    sum_leaves,
    sum_nodes,
    tag_inserted,
)

__all__ = [
    "PipelineStages",
    "StagePrograms",
    "TiedGradient",
    "balance",
    "layer_modules",
    "split_stages",
]

aten = torch.ops.aten


@dataclasses.dataclass(frozen=True)
class TiedGradient:
    """A parameter held by several stages: each stage's backward outputs its part of the
    gradient under `name`; the parts are summed across `stages` before the update."""

    name: str
    target: str
    stages: tuple[int, ...]


@dataclasses.dataclass
class StagePrograms:
    """One stage's programs and how their inputs and outputs are named.

    Input names: a state input's weight key (`blocks.0.attn.qkv.weight`), a batch input's
    signature name (`batch_0`: this stage's micro-batch of it), `act:<node>` for an activation
    received from the previous stage, `res:<node>` for a residual, `grad:<node>` for a gradient
    of an activation sent, `acc:<node>` for a gradient summed over micro-batches (the update's).
    """

    index: int
    forward: Program
    backward: Program
    backward_input: Program
    backward_weight: Program
    update: Program
    modules: tuple[str, ...]  # the module paths whose ops run here, in order
    receives: tuple[str, ...]  # forward inputs that come from the previous stage
    sends: tuple[str, ...]  # forward outputs that go to the next stage (empty on the last)
    grads_sent: tuple[str, ...]  # backward outputs: gradients of the float `receives`
    param_grads: tuple[str, ...]  # backward outputs after them: gradient names, summed over mbs
    grad_targets: tuple[str, ...]  # the weight key of each of `param_grads`
    state: tuple[str, ...]  # weight keys this stage holds (parameters, buffers, optimizer state)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.forward.signature.inputs)


@dataclasses.dataclass
class PipelineStages:
    """The stages of a pipelined step: `stages[s]` runs on pipeline rank `s % ranks` (its
    `s // ranks`-th local stage), as torch.distributed.pipelining's interleaved schedules place
    them."""

    pipeline: Pipeline
    stages: list[StagePrograms]
    ranks: int
    microbatches: int
    batch_inputs: tuple[str, ...]  # the step's batch inputs, signature order
    split_points: tuple[str, ...]  # the module paths where stages 1, 2, ... begin
    tied: tuple[TiedGradient, ...]
    loss_name: str
    outputs: tuple[OutputSpec, ...]  # the step's outputs (loss, updated state, metrics)
    owner: dict[str, int]  # output name -> the stage whose update (or forward) computes it

    def stages_of_rank(self, rank: int) -> list[StagePrograms]:
        return [s for s in self.stages if s.index % self.ranks == rank]


def split_stages(program: Program) -> PipelineStages:
    """The stages of `program` (a training step whose plan has a pipeline); PlanError naming
    the op, its module and source line, with a fix, where the step cannot be cut."""
    plan = program.plan
    if plan.pipeline is None or plan.mesh is None:
        raise PlanError("split_stages needs a plan with a pipeline", fix="Plan(pipeline=...)")
    if program.kind is not ProgramKind.TRAINING_STEP:
        raise PlanError(
            "pipeline parallelism cuts a training step; this program is an inference program",
            fix="capture the step with loss_fn= and optimizer=",
        )
    pipeline = plan.pipeline
    n_stages = pipeline.stage_count(plan.mesh)
    recipe = recipe_of(program.metadata)
    coupled = {}
    if recipe.clip_grad_norm is not None:
        coupled["clip_grad_norm"] = (
            f"clip_grad_norm={recipe.clip_grad_norm} (the global gradient norm)"
        )
    if recipe.precision.loss_scale is not None:
        coupled["the float16 loss scale"] = "the float16 loss scale (the global overflow check)"
    if coupled:
        raise PlanError(
            f"the recipe's {' and '.join(coupled.values())} reads the gradients of every "
            "stage; a pipelined step does not compute it across stages yet",
            fix=f"capture without {' and '.join(coupled)} for this plan, or run without a "
            "pipeline axis",
        )
    accumulate = recipe.accumulate
    if accumulate != pipeline.microbatches:
        raise PlanError(
            f"the pipeline runs {pipeline.microbatches} micro-batches per step but the step was "
            f"captured with accumulate={accumulate}",
            fix=f"capture with Recipe(accumulate={pipeline.microbatches}) (the single-device "
            "program with the same accumulation)",
        )
    # a copy: the split re-tags the phases of ops an earlier pass inserted
    program = program.replace()
    return _Splitter(program, pipeline, n_stages, plan.mesh.axis_size(pipeline.axis)).run()


# --- where each op runs ----------------------------------------------------------------------


def _module(node: torch.fx.Node) -> str | None:
    source = node.meta.get("source")
    return source.module if isinstance(source, SourceLoc) else None


def _where(node: torch.fx.Node) -> str:
    source = node.meta.get("source")
    where = str(source) if isinstance(source, SourceLoc) else "<unknown>"
    return f"{node.target} ({node.name}) at {where}"


class _Splitter:
    def __init__(self, program: Program, pipeline: Pipeline, n_stages: int, ranks: int) -> None:
        self.program = program
        self.pipeline = pipeline
        self.n = n_stages
        self.ranks = ranks
        self.sig = program.signature
        self.graph = program.graph
        self.placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        self.spec_of = {i.name: i for i in self.sig.inputs}
        self.stage: dict[torch.fx.Node, int] = {}

    # -- the template: micro-batch 0's ops -----------------------------------------------------
    def run(self) -> PipelineStages:
        nodes = [n for n in self.graph.nodes if n.op == "call_function"]
        tag_inserted(nodes)
        self.template = [
            n
            for n in nodes
            if n.meta.get(PHASE) in ("forward", "backward") and n.meta.get(MICRO_BATCH, 0) == 0
        ]
        members = set(self.template)
        self.optimizer_nodes = [n for n in nodes if n.meta.get(PHASE) == "optimizer"]
        self._batch_inputs(members)
        self._loss()
        self._refuse_forward_state_updates()
        self._free(members)
        self._assign()
        self._gradients()
        self._move_gradient_views()
        self._check_edges()
        return self._build()

    def _batch_inputs(self, members: set[torch.fx.Node]) -> None:
        """`self.micro_of`: the node standing for micro-batch 0 of each batch input -> its
        name; `self.slicing`: the ops taking it (each stage is given its micro-batch)."""
        self.micro_of: dict[torch.fx.Node, str] = {}
        self.slicing: set[torch.fx.Node] = set()
        for spec in self.sig.user_inputs:
            node = self.placeholders[spec.name]
            micro = node
            for view in node.users:
                select = next((u for u in view.users if u.target is aten.select.int), None)
                if view in members and view.target is aten.view.default and select is not None:
                    self.slicing |= {view, select}
                    micro = select
            self.micro_of[micro] = spec.name

    def _loss(self) -> None:
        loss_spec = self.sig.outputs_of(OutputKind.LOSS)[0]
        self.loss_name = loss_spec.name
        outs = typing.cast(tuple[torch.fx.Node, ...], self.graph.output_node().args[0])
        values = dict(zip((o.name for o in self.sig.outputs), outs, strict=True))
        # micro-batch 0's loss under the sum ((l0 + l1) + l2) + ... of the micro-batch losses
        self.loss = first_micro_batch(values[loss_spec.name])
        self.values = values
        # what the loss reads is forward, whatever capture said: spmd-partition computes a mean
        # loss as a global sum over a global count, and the count came from the backward
        for node in closure_up(self.loss, ()):
            if node.op == "call_function" and node.meta.get(PHASE) == "backward":
                node.meta[PHASE] = "forward"

    def _refuse_forward_state_updates(self) -> None:
        for out in self.sig.outputs_of(OutputKind.UPDATED_STATE, OutputKind.UPDATED_INPUT):
            node = self.values[out.name]
            if node.op == "call_function" and node.meta.get(PHASE) != "optimizer":
                raise PlanError(
                    f"the model updates {out.target or out.name} in its forward pass "
                    f"({_where(node)}); a pipelined step does not carry buffer updates between "
                    "stages yet",
                    fix="run this model without a pipeline axis, or make the buffer constant "
                    "(eval-mode BatchNorm, no running statistics)",
                )

    def _free(self, members: set[torch.fx.Node]) -> None:
        """Ops that depend on no parameter and no batch input: recomputed where read."""
        live_inputs = {
            self.placeholders[i.name]
            for i in self.sig.inputs
            if i.kind in (InputKind.PARAMETER, InputKind.USER_INPUT)
        }
        live: set[torch.fx.Node] = set(live_inputs)
        for node in self.template:
            if any(a in live for a in node.all_input_nodes):
                live.add(node)
        self.free = {n for n in self.template if n not in live}
        self.live = [n for n in self.template if n in live and n not in self.slicing]

    # -- stage assignment ----------------------------------------------------------------------
    def _split_positions(self, forward: list[torch.fx.Node]) -> list[int]:
        modules: list[str] = []
        for node in forward:
            module = _module(node)
            if module and module not in modules:
                modules.append(module)
        self.module_order = modules
        points = list(self.pipeline.split_points)
        if not points:
            layers = layer_modules(modules)
            if len(layers) < self.n:
                raise PlanError(
                    f"the pipeline has {self.n} stages but the model has {len(layers)} "
                    f"repeated layers ({', '.join(layers[:4]) or 'none found'})",
                    fix="use fewer stages, or name the stage boundaries with "
                    "Pipeline(split_points=[module paths])",
                )
            costs = [0.0] * len(layers)
            first_layer = None
            for i, node in enumerate(forward):
                module = _module(node) or ""
                layer = next((k for k, p in enumerate(layers) if _under(module, p)), None)
                if layer is None:  # embeddings before the layers, the head and loss after
                    layer = 0 if first_layer is None else len(layers) - 1
                else:
                    first_layer = i if first_layer is None else first_layer
                costs[layer] += flops(node)
            points = [layers[i] for i in balance(costs, self.n)[1:]]
        self.split_points = tuple(points)
        positions: list[int] = []
        for point in points:
            at = next((i for i, n in enumerate(forward) if _under(_module(n) or "", point)), None)
            if at is None:
                raise PlanError(
                    f"pipeline split point {point!r} names no module the forward pass runs",
                    fix="use module paths from the model: "
                    + ", ".join(layer_modules(modules)[:6] or modules[:6]),
                )
            if positions and at <= positions[-1]:
                raise PlanError(
                    f"pipeline split points are not in forward order: {point!r} runs before "
                    f"{points[len(positions) - 1]!r}",
                    fix="list split points in the order the forward pass runs them",
                )
            positions.append(at)
        return positions

    def _assign(self) -> None:
        forward = [n for n in self.live if n.meta[PHASE] == "forward"]
        positions = self._split_positions(forward)
        module_stage: dict[str, int] = {}
        for i, node in enumerate(forward):
            stage = bisect.bisect_right(positions, i)
            stage = max([stage] + [self.stage[a] for a in node.all_input_nodes if a in self.stage])
            self.stage[node] = stage
            module = _module(node)
            if module is not None:
                module_stage[module] = max(module_stage.get(module, 0), stage)
        if self.stage.get(self.loss) != self.n - 1:
            raise PlanError(
                f"the loss ({_where(self.loss)}) falls in stage {self.stage.get(self.loss)}, "
                f"not the last ({self.n - 1})",
                fix="move the last split point before the model's head",
            )
        # a forward value belongs, for its backward, to the stage that consumes it: a received
        # activation's backward runs where it was received
        consumer = dict(self.stage)
        for node in forward:
            for arg in node.all_input_nodes:
                if arg in consumer:
                    consumer[arg] = max(consumer[arg], self.stage[node])
        # a batch input read by one stage's forward: the backward of the op reading it (an
        # embedding's) runs there too
        for micro in self.micro_of:
            stages = {self.stage[u] for u in micro.users if u in self.stage}
            if len(stages) == 1 and all(
                u.meta.get(PHASE) == "forward" for u in micro.users if u in self.stage
            ):
                consumer[micro] = stages.pop()
        for node in self.live:
            if node.meta[PHASE] != "backward":
                continue
            reads_fwd = [
                consumer[a]
                for a in node.all_input_nodes
                if (a in self.stage and a.meta.get(PHASE) == "forward") or a in self.micro_of
                if a in consumer
            ]
            reads_bwd = [
                self.stage[a]
                for a in node.all_input_nodes
                if a in self.stage and a.meta.get(PHASE) == "backward"
            ]
            if reads_fwd:
                stage = max(reads_fwd)
            elif reads_bwd:
                stage = min(reads_bwd)
            else:
                stage = self.n - 1
            self.stage[node] = stage
        # each parameter's stages: those whose forward reads it
        self.param_stages: dict[str, set[int]] = {}
        for spec in self.sig.inputs_of(InputKind.PARAMETER):
            users = self.placeholders[spec.name].users
            stages = {self.stage[u] for u in users if u in self.stage}
            self.param_stages[spec.key] = stages

    def _gradients(self) -> None:
        """Each final gradient the update reads, traced to micro-batch 0's gradient; a sum of
        parts computed on different stages becomes a `TiedGradient`."""
        self.grad_of: dict[torch.fx.Node, torch.fx.Node] = {}  # final gradient -> template
        for node in self.optimizer_nodes:
            for arg in node.all_input_nodes:
                if arg.meta.get(PHASE) == "backward" and arg not in self.grad_of:
                    self.grad_of[arg] = first_micro_batch(arg)
        self.param_of: dict[torch.fx.Node, str] = {}  # template gradient -> weight key
        for out in self.sig.outputs_of(OutputKind.UPDATED_PARAMETER):
            finals = closure_up(self.values[out.name], set(self.grad_of)) & set(self.grad_of)
            for final in finals:
                self.param_of[self.grad_of[final]] = out.key
        self.parts: dict[torch.fx.Node, list[torch.fx.Node]] = {}
        for grad in set(self.grad_of.values()):
            stages = self.param_stages.get(self.param_of.get(grad, ""), set())
            if len(stages) == 1 and grad in self.stage:
                self.stage[grad] = min(stages)  # a gradient is computed where its parameter is
                continue
            leaves = sum_leaves(grad, self.stage)
            if len({self.stage[leaf] for leaf in leaves}) > 1:
                self.parts[grad] = leaves
                for node in sum_nodes(grad, self.stage):
                    self.live.remove(node)
                    del self.stage[node]

    def _move_gradient_views(self) -> None:
        """Reassign gradient-only ops (below)."""
        # an op that only reshapes gradients for the previous stage (the view of the incoming
        # gradient its matmuls read) runs there: the gradient itself is what crosses
        live = set(self.live)
        for node in reversed(self.live):
            if node.meta[PHASE] != "backward":
                continue
            users = {self.stage[u] for u in node.users if u in live and u in self.stage}
            reads_fwd = any(
                a in self.stage and a.meta[PHASE] == "forward" for a in node.all_input_nodes
            )
            staged = [a for a in node.all_input_nodes if a in self.stage]
            single = len(staged) == 1 and tensor_of(staged[0]) is not None
            if users and max(users) < self.stage[node] and not reads_fwd and single:
                self.stage[node] = max(users)

    def _check_edges(self) -> None:
        """Activations flow one stage forward, their gradients one stage back."""
        for node in self.live:
            here = self.stage[node]
            for arg in node.all_input_nodes:
                if arg not in self.stage:
                    continue
                there, phase = self.stage[arg], arg.meta[PHASE]
                ok = there == here or (
                    there == here - 1 if phase == "forward" else there == here + 1
                )
                if phase == "backward" and node.meta[PHASE] == "forward":
                    ok = False
                if not ok:
                    raise PlanError(
                        f"stage {here} op {_where(node)} reads {arg.name} from stage {there}: a "
                        f"pipeline sends activations one stage forward and gradients one back",
                        fix="move the split points so that this value stays within a stage "
                        "(cut between the model's repeated layers)",
                    )

    # -- building the programs -----------------------------------------------------------------
    def _build(self) -> PipelineStages:
        stage_nodes: list[list[torch.fx.Node]] = [[] for _ in range(self.n)]
        for node in self.live:
            stage_nodes[self.stage[node]].append(node)
        # activations crossing each cut, and the gradients coming back over it
        sends: list[list[torch.fx.Node]] = [[] for _ in range(self.n)]
        grads_back: list[list[torch.fx.Node]] = [[] for _ in range(self.n)]
        for node in self.live:
            for arg in node.all_input_nodes:
                if arg in self.stage and self.stage[arg] == self.stage[node] - 1:
                    if arg.meta[PHASE] == "forward" and arg not in sends[self.stage[arg]]:
                        sends[self.stage[arg]].append(arg)
                if arg in self.stage and self.stage[arg] == self.stage[node] + 1:
                    if arg not in grads_back[self.stage[node]]:
                        grads_back[self.stage[node]].append(arg)
        pairing = [self._pair(s, sends[s], grads_back[s]) for s in range(self.n)]
        tied = []
        for grad, leaves in self.parts.items():
            holders = tuple(sorted({self.stage[leaf] for leaf in leaves}))
            target = self.param_of.get(grad, grad.name)
            tied.append(TiedGradient(grad.name, target, holders))
        stages = [self._stage(s, stage_nodes[s], sends, pairing) for s in range(self.n)]
        owner = self._owners(stages)
        return PipelineStages(
            self.pipeline,
            stages,
            self.ranks,
            self.pipeline.microbatches,
            tuple(i.name for i in self.sig.user_inputs),
            self.split_points,
            tuple(tied),
            self.loss_name,
            self.sig.outputs,
            owner,
        )

    def _pair(
        self, s: int, sent: list[torch.fx.Node], back: list[torch.fx.Node]
    ) -> list[torch.fx.Node | None]:
        """For each activation stage s sends, the gradient that comes back for it (None for a
        value without one: an integer tensor)."""
        pairs: list[torch.fx.Node | None] = []
        left = list(back)
        for act in sent:
            val = tensor_of(act)
            assert val is not None  # a tuple-valued op is never sent: its elements are
            if not val.dtype.is_floating_point:
                pairs.append(None)
                continue
            same = [g for g in left if tensor_of(g) == val]
            if len(same) != 1 and not (same and len(sent) == 1):
                raise PlanError(
                    f"cannot tell which gradient comes back for activation {_where(act)} "
                    f"crossing from stage {s} to {s + 1} ({len(same)} candidates of shape "
                    f"{tuple(val.shape)})",
                    fix="cut where one activation (the residual stream) crosses: between the "
                    "model's repeated layers",
                )
            pairs.append(same[0])
            left.remove(same[0])
        if left:
            raise PlanError(
                f"stage {s + 1} sends back gradients {[g.name for g in left]} for no activation "
                f"of stage {s}",
                fix="cut between the model's repeated layers",
            )
        return pairs

    def _stage(
        self,
        s: int,
        nodes: list[torch.fx.Node],
        sends: list[list[torch.fx.Node]],
        pairing: list[list[torch.fx.Node | None]],
    ) -> StagePrograms:
        fwd = [n for n in nodes if n.meta[PHASE] == "forward"]
        fwd_set = set(fwd)
        # the backward's element reads of a forward op's tuple run in the forward program, so
        # that residuals are tensors
        for node in nodes:
            if node.meta[PHASE] == "backward" and node.target is operator.getitem:
                source = node.args[0]
                if source in fwd_set:
                    fwd.append(node)
        fwd_set = set(fwd)
        bwd = [n for n in nodes if n not in fwd_set]
        last = s == self.n - 1
        receives = sends[s - 1] if s else []
        received = {a: f"act:{a.name}" for a in receives}
        out_acts = sends[s] if not last else []
        bwd_set = set(bwd)
        # residuals: stage values (forward ops, received activations) that backward reads
        residuals = []
        for node in bwd:
            for arg in node.all_input_nodes:
                if (arg in received or arg in fwd_set) and arg not in residuals:
                    residuals.append(arg)
        # the forward program
        fwd_outputs = [(f"out:{a.name}", a) for a in out_acts]
        if last:
            fwd_outputs.append((self.loss_name, self.loss))
        fwd_outputs += [(f"res:{r.name}", r) for r in residuals]
        forward = self._program(f"stage{s}.forward", fwd, received, fwd_outputs)
        # the backward program
        grads_in = {
            g: f"grad:{a.name}" for a, g in zip(sends[s], pairing[s], strict=True) if g is not None
        } if not last else {}  # fmt: skip
        bwd_inputs = {**{r: f"res:{r.name}" for r in residuals}, **grads_in}
        grads_sent = []
        if s:
            for act, grad in zip(sends[s - 1], pairing[s - 1], strict=True):
                if grad is not None:
                    grads_sent.append((f"grad:{act.name}", grad))
        param_grads: list[tuple[str, torch.fx.Node | _SumOf]] = []
        for grad in self.grad_of.values():
            if grad in self.parts:
                leaves = [leaf for leaf in self.parts[grad] if self.stage[leaf] == s]
                if leaves:
                    param_grads.append((grad.name, _SumOf(leaves)))
            elif grad in bwd_set:
                param_grads.append((grad.name, grad))
        param_grads = list(dict(param_grads).items())
        by_name = {g.name: g for g in self.grad_of.values()}
        grad_nodes = [by_name[name] for name, _ in param_grads]
        backward = self._program(f"stage{s}.backward", bwd, bwd_inputs, grads_sent + param_grads)
        backward_input, backward_weight = self._zero_bubble_split(
            s, bwd, bwd_inputs, grads_sent, param_grads
        )
        update = self._update(s, {g for g, _ in param_grads})
        programs = (forward, backward, update)
        state = tuple(
            dict.fromkeys(
                label
                for p in programs
                for label in p.metadata["pipeline"]["inputs"].values()
                if label in self.program.weights
            )
        )
        modules = tuple(dict.fromkeys(m for n in fwd if (m := _module(n)) is not None))
        return StagePrograms(
            s,
            forward,
            backward,
            backward_input,
            backward_weight,
            update,
            modules,
            tuple(received.values()),
            tuple(name for name, _ in fwd_outputs[: len(out_acts)]),
            tuple(name for name, _ in grads_sent),
            tuple(name for name, _ in param_grads),
            tuple(self.param_of.get(g, g.name) for g in grad_nodes),
            state,
        )

    def _zero_bubble_split(
        self,
        s: int,
        bwd: list[torch.fx.Node],
        inputs: dict[torch.fx.Node, str],
        grads_sent: list[tuple[str, typing.Any]],
        param_grads: list[tuple[str, typing.Any]],
    ) -> tuple[Program, Program]:
        """(input-gradient program, weight-gradient program): the first computes what the
        previous stage waits for and stashes what the second needs."""
        needed_in = ancestors([v for _, v in grads_sent], set(bwd))
        needed_in |= {n for n in bwd if n.target is operator.getitem and n.args[0] in needed_in}
        first = [n for n in bwd if n in needed_in]
        rest = [n for n in bwd if n not in needed_in]
        made = set(first) | set(inputs)
        stash = []
        for node in rest:
            for arg in node.all_input_nodes:
                if arg in made and arg not in stash and arg not in self.free:
                    stash.append(arg)
        for _, value in param_grads:
            for arg in value.nodes if isinstance(value, _SumOf) else [value]:
                if arg in made and arg not in stash:
                    stash.append(arg)
        names = {v: f"stash:{v.name}" for v in stash}
        b_input = self._program(
            f"stage{s}.backward_input",
            first,
            inputs,
            grads_sent + [(names[v], v) for v in stash],
        )
        b_weight = self._program(f"stage{s}.backward_weight", rest, names, param_grads)
        return b_input, b_weight

    def _update(self, s: int, grads_here: set[str]) -> Program:
        """The update of the parameters (and their optimizer state) whose gradients this stage
        computes, plus the step-wide scalars (the step counter, lr) every stage computes."""
        every = {g.name for g in self.grad_of.values()}
        outputs = []
        for out in self.sig.outputs:
            if out.kind is OutputKind.LOSS:
                continue
            value = self.values[out.name]
            if value.op != "placeholder" and value.meta.get(PHASE) != "optimizer":
                continue  # refused earlier: forward-pass state updates
            grads = {
                self.grad_of[a].name
                for a in closure_up(value, set(self.grad_of))
                if a in self.grad_of
            }
            if grads and not grads <= grads_here:
                if grads & grads_here or (out.kind is OutputKind.METRIC and grads == every):
                    raise PlanError(
                        f"the step's {out.name} reads the gradients of several stages (a "
                        "global gradient norm or overflow check); a pipelined step does not "
                        "compute it across stages yet",
                        fix="drop clip_grad_norm / the float16 loss scale for this plan, or "
                        "run without a pipeline axis",
                    )
                continue
            if grads or out.kind is OutputKind.METRIC or value.op != "placeholder":
                outputs.append(out)
        inputs = {f: f"acc:{g.name}" for f, g in self.grad_of.items() if g.name in grads_here}
        nodes = ancestors([self.values[o.name] for o in outputs], set(self.optimizer_nodes))
        ordered = [n for n in self.optimizer_nodes if n in nodes]
        return self._program(
            f"stage{s}.update", ordered, inputs, [(o.name, self.values[o.name]) for o in outputs]
        )

    def _owners(self, stages: list[StagePrograms]) -> dict[str, int]:
        owner: dict[str, int] = {self.loss_name: self.n - 1}
        for stage in stages:
            for out in stage.update.signature.outputs:
                owner.setdefault(out.name, stage.index)
        missing = [o.name for o in self.sig.outputs if o.name not in owner]
        if missing:
            raise PlanError(f"no stage computes the step's outputs {missing[:4]}")
        return owner

    def _program(
        self,
        name: str,
        nodes: list[torch.fx.Node],
        inputs: dict[torch.fx.Node, str],
        outputs: Sequence[tuple[str, typing.Any]],
    ) -> Program:
        """A program computing `outputs` from `nodes`, taking `inputs` (and any placeholder of
        the step they read: a weight by its key, a batch input's micro-batch by its name) as
        inputs; free ops they read are copied in."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        specs: list[InputSpec] = []
        by_name: dict[str, torch.fx.Node] = {}

        def placeholder(src: torch.fx.Node, label: str) -> torch.fx.Node:
            if label in by_name:
                return by_name[label]
            node = graph.placeholder(_identifier(label, len(specs)))
            node.meta.update({k: v for k, v in src.meta.items() if k in ("val", "tensor")})
            specs.append(InputSpec(node.name, InputKind.USER_INPUT, _spec(src)))
            by_name[label] = node
            return node

        def value(src: torch.fx.Node) -> torch.fx.Node:
            if src in env:
                return env[src]
            if src in inputs:
                env[src] = placeholder(src, inputs[src])
            elif src in self.micro_of:
                env[src] = placeholder(src, self.micro_of[src])
            elif src.op == "placeholder":
                spec = self.spec_of[src.name]
                env[src] = placeholder(src, spec.target or spec.name)
            elif src in self.free or src in own or src.meta.get(PHASE) == "optimizer":
                copy(src)
            else:
                raise PlanError(f"{name} reads {src.name}, which no stage gives it")
            return env[src]

        own = set(nodes)

        def copy(src: torch.fx.Node) -> None:
            args = torch.fx.node.map_arg(src.args, value)
            kwargs = torch.fx.node.map_arg(src.kwargs, value)
            node = graph.call_function(src.target, args, kwargs)  # type: ignore[arg-type]
            node.meta = dict(src.meta)
            env[src] = node

        for src in nodes:
            if src not in env:
                value(src)
        results = []
        out_specs = []
        for label, src in outputs:
            if isinstance(src, _SumOf):
                total = value(src.nodes[0])
                for part in src.nodes[1:]:
                    add = graph.call_function(aten.add.Tensor, (total, value(part)))
                    add.meta.update({k: v for k, v in part.meta.items() if k in ("val", "tensor")})
                    total = add
                node, meta = total, src.nodes[0].meta
            else:
                node, meta = value(src), src.meta
            results.append(node)
            out_specs.append(OutputSpec(label, OutputKind.OUTPUT, _spec_of_meta(meta)))
        graph.output(tuple(results))
        graph.eliminate_dead_code()
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        for node in [n for n in graph.nodes if n.op == "placeholder"]:
            anchor.prepend(node)  # placeholders first, in signature order
        gm = torch.fx.GraphModule(self.program.graph_module, graph)
        kept = {n.name for n in graph.nodes if n.op == "placeholder"}
        specs = [s for s in specs if s.name in kept]
        program = Program(
            ProgramKind.INFERENCE,
            gm,
            Signature(tuple(specs), tuple(out_specs)),
            {},
            metadata={
                "name": f"{self.program.name}.{name}",
                "pipeline": {
                    "inputs": {n.name: label for label, n in by_name.items() if n.name in kept}
                },
            },
        )
        return program


@dataclasses.dataclass(frozen=True)
class _SumOf:
    """An output that is the sum of several template values (a tied gradient's part)."""

    nodes: list[torch.fx.Node]


def _identifier(label: str, index: int) -> str:
    name = re.sub(r"\W", "_", label)
    return name if name and not name[0].isdigit() else f"in{index}_{name}"


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _spec(node: torch.fx.Node) -> TensorSpec:
    return _spec_of_meta(node.meta)


def _spec_of_meta(meta: dict[str, typing.Any]) -> TensorSpec:
    spec = meta.get("tensor")
    if isinstance(spec, TensorSpec):
        return spec
    return TensorSpec.of(meta["val"])
