"""Complete a joint forward+backward graph into a training step: splice in the recipe's update.

torch.export + AOT autograd give a graph `(params, buffers, batch) -> (buffer updates, loss,
gradients)` (with accumulation, N forward/backward pairs whose gradients are summed:
accumulate.py). This module adds the step's state inputs (the step counter, per-parameter
optimizer state, the loss scale), traces the update with `make_fx` to core ATen and copies it into
the graph. The update, in the order of the eager loop it replaces:

    grads = grads * (1 / scale), found_inf = any non-finite     scaler.unscale_(opt)  (float16)
    grad_norm = ||(||g_1||, ..., ||g_n||)||; grads *= min(1, max_norm / (grad_norm + 1e-6))
                                                                clip_grad_norm_(params, max_norm)
    grads = clamp(grads, -v, v)                                 clip_grad_value_(params, v)
    lr_g = schedule.lr(start + step, base_lr_g) per group       scheduler.get_last_lr()
    params, state = optimizer.update(..., lr_g, weight_decay_g) opt.step()
    skip the update where found_inf; scale grows / backs off    scaler.step(opt); scaler.update()

Outputs become `(loss, updated parameters, updated step state, updated buffers, metrics)`, each
updated value aliasing the input it replaces; the metrics are `lr` (the optimizer's base group),
`grad_norm` (the pre-clip global norm, with clip_grad_norm) and `loss_scale` (float16).
Gradients are consumed inside the graph.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import CaptureError
from ..ir.program import Program
from ..ir.signature import InputKind, InputSpec, OutputKind, OutputSpec, Signature, TensorSpec
from ..ir.source import SourceLoc
from ..optim import Optimizer
from ..recipe import Recipe
from .abstract import fake_value
from .build import tensor_meta
from .decompositions import decompositions

__all__ = ["MICRO_BATCH", "PHASE", "STEP_TARGET", "add_optimizer", "tag_phases"]

STEP_TARGET = "optimizer.step"
SCALE_TARGET = "amp.scale"
TRACKER_TARGET = "amp.growth_tracker"
PHASE = "phase"  # node.meta key: "forward", "backward" or "optimizer" in a training step
MICRO_BATCH = "micro_batch"  # node.meta key: the micro-batch a forward/backward node belongs to
MICRO_LOSS = "micro_loss"  # node.meta key: True on each micro-batch's loss (accumulate.py)
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def tag_phases(program: Program, micro_batch: int = 0) -> None:
    """Mark each op of a joint forward+backward graph: `forward` if the loss depends on it,
    else `backward`; every op gets `micro_batch`. Ops already tagged keep their tag."""
    graph = program.graph
    out_args = typing.cast(tuple[torch.fx.Node, ...], graph.output_node().args[0])
    loss = next(
        v
        for o, v in zip(program.signature.outputs, out_args, strict=True)
        if o.kind == OutputKind.LOSS
    )
    forward: set[torch.fx.Node] = set()
    stack = [loss]
    while stack:
        node = stack.pop()
        if node in forward or node.op != "call_function":
            continue
        forward.add(node)
        stack.extend(node.all_input_nodes)
    for node in graph.nodes:
        if node.op == "call_function" and PHASE not in node.meta:
            node.meta[PHASE] = "forward" if node in forward else "backward"
            node.meta[MICRO_BATCH] = micro_batch


def _placeholder_name(target: str) -> str:
    return "opt_" + re.sub(r"[^A-Za-z0-9_]", "_", target.removeprefix("optimizer."))


@dataclasses.dataclass(frozen=True)
class _Update:
    """The traced update's layout: n parameters with their groups, k state tensors each."""

    optimizer: Optimizer
    recipe: Recipe
    groups: tuple[int, ...]  # per parameter: its group index
    keys: tuple[tuple[str, ...], ...]  # per parameter: its state's names (Adafactor: by shape)

    @property
    def scaled(self) -> bool:
        return self.recipe.precision.loss_scale is not None

    def __call__(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.groups)
        params, grads = list(flat[:n]), list(flat[n : 2 * n])
        rest = list(flat[2 * n :])
        states = []
        for keys in self.keys:
            states.append(dict(zip(keys, rest[: len(keys)], strict=True)))
            rest = rest[len(keys) :]
        step, *amp = rest
        found_inf = None
        if self.scaled:
            grads, found_inf = _unscale(grads, amp[0])
        metrics: list[torch.Tensor] = []
        grads, norm = self._clip(grads)
        lrs = self._lrs(step)
        metrics.append(lrs[0])
        if norm is not None:
            metrics.append(norm)
        new_params: list[torch.Tensor] = []
        new_states: list[torch.Tensor] = []
        for param, grad, group, state in zip(params, grads, self.groups, states, strict=True):
            _, weight_decay = self.optimizer.group_hyper(group)
            p, s = self.optimizer.update(param, grad, state, step, lrs[group], weight_decay)
            if found_inf is not None:  # GradScaler.step skips the update
                p = torch.where(found_inf, param, p)
                s = {k: torch.where(found_inf, state[k], s[k]) for k in state}
            new_params.append(p)
            new_states.extend(s[k] for k in state)
        if found_inf is None:
            return (*new_params, *new_states, step + 1, *metrics)
        new_step = torch.where(found_inf, step, step + 1)
        scale, tracker = _update_scale(amp[0], amp[1], found_inf, self.recipe)
        return (*new_params, *new_states, new_step, scale, tracker, *metrics, amp[0])

    def _clip(self, grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        norm = None
        if self.recipe.clip_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: the norm of the per-parameter norms, then every
            # gradient times min(1, max_norm / (norm + 1e-6)) (also when it is 1)
            norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            coef = torch.clamp(self.recipe.clip_grad_norm / (norm + CLIP_EPS), max=1.0)
            grads = [g * coef for g in grads]
        value = self.recipe.clip_grad_value
        if value is not None:  # clip_grad_value_: clamp_min then clamp_max
            grads = [g.clamp_min(-value).clamp_max(value) for g in grads]
        return grads, norm

    def _lrs(self, step: torch.Tensor) -> list[torch.Tensor]:
        """Each group's lr this step (float64, 0-d): the schedule at start + step."""
        t = step.to(torch.float64)
        if self.recipe.start:
            t = t + float(self.recipe.start)
        schedule = self.recipe.schedule
        lrs = []
        for group in range(max(self.groups, default=0) + 1):
            base, _ = self.optimizer.group_hyper(group)
            lrs.append(torch.full_like(t, base) if schedule is None else schedule.lr(t, base))
        return lrs


def _unscale(
    grads: Sequence[torch.Tensor], scale: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """GradScaler.unscale_: each gradient times the float32 reciprocal of the scale (computed in
    float64, as torch does); found_inf if any scaled gradient holds an inf or NaN."""
    inv_scale = scale.to(torch.float64).reciprocal().to(torch.float32)
    bad = [(torch.isnan(g) | torch.isinf(g)).any() for g in grads]
    found_inf = torch.stack(bad).any()
    return [g * inv_scale for g in grads], found_inf


def _update_scale(
    scale: torch.Tensor, tracker: torch.Tensor, found_inf: torch.Tensor, recipe: Recipe
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch._amp_update_scale_: back off on inf/NaN; grow after `interval` good steps (unless
    growing overflows, which keeps the scale and restarts the count)."""
    policy = recipe.precision.loss_scale
    assert policy is not None
    good = tracker + 1
    grow = good >= policy.interval
    grown = scale * policy.growth
    grown = torch.where(torch.isinf(grown), scale, grown)
    new_scale = torch.where(found_inf, scale * policy.backoff, torch.where(grow, grown, scale))
    zero = torch.zeros_like(tracker)
    new_tracker = torch.where(found_inf, zero, torch.where(grow, zero, good))
    return new_scale, new_tracker


def add_optimizer(program: Program, optimizer: Optimizer, recipe: Recipe | None = None) -> Program:
    """Splice `recipe`'s update (module doc) into the joint graph of a training step."""
    recipe = recipe or Recipe()
    tag_phases(program)
    graph = program.graph
    sig = program.signature
    grads = sig.outputs_of(OutputKind.GRADIENT)
    if not grads:
        raise CaptureError(
            "the loss does not depend on any trainable parameter",
            fix="check that loss_fn calls the model and that parameters have requires_grad=True",
        )
    params = {i.key: i for i in sig.inputs_of(InputKind.PARAMETER)}
    out_node = graph.output_node()
    # the IR's output node returns one flat tuple of nodes (the verifier holds it to that)
    out_args = typing.cast(tuple[torch.fx.Node, ...], out_node.args[0])
    out_values = dict(zip((o.name for o in sig.outputs), out_args, strict=True))
    placeholders = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    first_user = next((placeholders[i.name] for i in sig.user_inputs), None)

    # 1. New inputs: the step counter, per-parameter optimizer state, the loss scale.
    new_inputs: list[InputSpec] = []
    weights = dict(program.weights)

    def add_input(target: str, value: torch.Tensor) -> torch.fx.Node:
        name = _placeholder_name(target)
        with graph.inserting_before(first_user if first_user is not None else out_node):
            node = graph.placeholder(name)
        node.meta["val"] = fake_value(value, graph)  # itself, unless it has no data
        node.meta["tensor"] = TensorSpec.of(value)
        new_inputs.append(
            InputSpec(node.name, InputKind.OPTIMIZER_STATE, node.meta["tensor"], target)
        )
        weights[target] = value
        return node

    step_node = add_input(STEP_TARGET, torch.zeros((), dtype=torch.float32))
    state_nodes: list[torch.fx.Node] = []
    keys: list[tuple[str, ...]] = []
    for grad in grads:
        init = optimizer.init_state(program.weights[grad.key])
        keys.append(tuple(k for k in optimizer.state_names if k in init))
        state_nodes += [add_input(f"optimizer.{grad.target}.{k}", init[k]) for k in keys[-1]]
    amp_nodes: list[torch.fx.Node] = []
    loss_scale = recipe.precision.loss_scale
    if loss_scale is not None:
        amp_nodes = [
            add_input(SCALE_TARGET, torch.tensor(loss_scale.init, dtype=torch.float32)),
            add_input(TRACKER_TARGET, torch.tensor(0.0, dtype=torch.float32)),
        ]
        _scale_backward_seeds(program, amp_nodes[0])

    # 2. Trace the update and copy it into the graph.
    groups = tuple(optimizer.group_of(g.key) for g in grads)
    update = _Update(optimizer, recipe, groups, tuple(keys))
    sources = [placeholders[params[g.key].name] for g in grads]
    sources += [out_values[g.name] for g in grads]
    sources += [*state_nodes, step_node, *amp_nodes]
    results = _splice(program, update, sources, out_node)

    # 3. Outputs: loss, updated parameters, updated state, updated buffers, metrics.
    n = len(grads)
    n_state = len(new_inputs)  # step, per-parameter state, amp
    new_params, new_state = results[:n], results[n : n + n_state]
    metrics = results[n + n_state :]
    loss = sig.outputs_of(OutputKind.LOSS)[0]
    outs = [(loss, out_values[loss.name])]
    for grad, value in zip(grads, new_params, strict=True):
        param = params[grad.key]
        outs.append((_updated(param, OutputKind.UPDATED_PARAMETER, grad.target), value))
    # the traced update returns the per-parameter state first, then the step and amp state
    state_specs = new_inputs[1 : 1 + len(state_nodes)] + [new_inputs[0]]
    state_specs += new_inputs[1 + len(state_nodes) :]
    for spec, value in zip(state_specs, new_state, strict=True):
        outs.append((_updated(spec, OutputKind.UPDATED_STATE, spec.target), value))
    outs += [(o, out_values[o.name]) for o in sig.outputs_of(OutputKind.UPDATED_STATE)]
    names = ["lr"] + (["grad_norm"] if recipe.clip_grad_norm is not None else [])
    names += ["loss_scale"] if loss_scale is not None else []
    for name, value in zip(names, metrics, strict=True):
        outs.append((OutputSpec(name, OutputKind.METRIC, value.meta["tensor"]), value))
    out_node.args = (tuple(v for _, v in outs),)
    graph.eliminate_dead_code()
    graph.lint()
    program.graph_module.recompile()

    ordered = (
        [i for i in sig.inputs if i.kind != InputKind.USER_INPUT]
        + new_inputs
        + list(sig.user_inputs)
    )
    program.signature = Signature(tuple(ordered), tuple(spec for spec, _ in outs))
    program.weights = weights
    program.metadata["optimizer"] = optimizer.to_dict()
    program.metadata["recipe"] = recipe.to_dict()
    return program


def _updated(spec: InputSpec, kind: OutputKind, target: str | None) -> OutputSpec:
    return OutputSpec(f"{target}.updated", kind, spec.spec, target, spec.name)


def _splice(
    program: Program, update: _Update, sources: list[torch.fx.Node], out_node: torch.fx.Node
) -> tuple[torch.fx.Node, ...]:
    """Trace `update` over fakes shaped like `sources` and copy it before `out_node`."""
    # Distinct tensor objects for every input: make_fx keys proxies by tensor identity, so a
    # tensor passed twice would trace as one input.
    examples = [torch.empty_like(s.meta["val"]) for s in sources]
    traced = make_fx(
        update,
        decomposition_table=decompositions(python_only=True),  # type: ignore[arg-type]
        tracing_mode="fake",
    )(*examples)
    if any(node.op == "get_attr" for node in traced.graph.nodes):
        raise CaptureError(f"optimizer {update.optimizer.kind} traced to a graph with constants")
    val_map = dict(
        zip((p for p in traced.graph.nodes if p.op == "placeholder"), sources, strict=True)
    )
    graph = program.graph
    with graph.inserting_before(out_node):
        # `update` returns a flat tuple, so the copy's result is a tuple of nodes
        results = typing.cast(tuple[torch.fx.Node, ...], graph.graph_copy(traced.graph, val_map))
    _mark_gradient_norms(graph, results, sources[: len(update.groups)])
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if PHASE not in node.meta:
            node.meta[PHASE] = "optimizer"
        if "source" not in node.meta:
            node.meta["source"] = SourceLoc(module=f"optimizer.{update.optimizer.kind}")
        if "tensor" not in node.meta and "val" in node.meta:
            node.meta["tensor"] = tensor_meta(node.meta["val"])
    return results


def _mark_gradient_norms(
    graph: torch.fx.Graph, results: Sequence[torch.fx.Node], params: Sequence[torch.fx.Node]
) -> None:
    """Mark clip_grad_norm's per-parameter norms with the parameter (`meta["norm_like"]`), in
    the order `_Update._clip` computes them: spmd-partition reduces a partial gradient into
    its parameter's sharding before taking its norm from the shards."""
    norm = torch.ops.aten.linalg_vector_norm.default
    stack = torch.ops.aten.stack.default
    new = [n for n in graph.nodes if n.op == "call_function" and PHASE not in n.meta]
    norms = [
        n
        for n in new
        if n.target is norm
        and not (isinstance(n.args[0], torch.fx.Node) and n.args[0].target is stack)
    ]
    if len(norms) == len(params):
        for node, param in zip(norms, params, strict=True):
            node.meta["norm_like"] = param.name


def _scale_backward_seeds(program: Program, scale: torch.fx.Node) -> None:
    """Start every backward from the loss scale instead of 1 (`scaler.scale(loss).backward()`:
    the gradient of loss * scale with respect to the loss is the scale, exactly)."""
    graph = program.graph
    losses = _loss_terms(program)
    seeds = [
        n
        for n in graph.nodes
        if n.op == "call_function"
        and n.target is torch.ops.aten.ones_like.default
        and n.args
        and n.args[0] in losses
    ]
    if len(seeds) != len(losses):
        raise CaptureError(
            f"loss scaling: found {len(seeds)} backward seeds for {len(losses)} losses",
            fix="report this with the model: the joint graph does not start its backward from "
            "ones_like(loss)",
        )
    for seed in seeds:
        with graph.inserting_after(seed):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (seed, scale))
        scaled.meta = dict(seed.meta)
        for user in [u for u in seed.users if u is not scaled]:
            user.replace_input_with(seed, scaled)


def _loss_terms(program: Program) -> set[torch.fx.Node]:
    """The losses backward passes start from: each micro-batch's (`MICRO_LOSS`, accumulate.py),
    or the loss output itself."""
    terms = {n for n in program.graph.nodes if n.meta.get(MICRO_LOSS)}
    if terms:
        return terms
    out_args = typing.cast(tuple[torch.fx.Node, ...], program.graph.output_node().args[0])
    return {
        v
        for o, v in zip(program.signature.outputs, out_args, strict=True)
        if o.kind == OutputKind.LOSS
    }
