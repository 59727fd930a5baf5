"""Capture: PyTorch model -> portable `Program` (inference or whole training step).

Pipeline (each stage in its own module):
1. `torch.export.export` (non-strict) of the model, or of a wrapper that returns
   `loss_fn(model, *batch)` for a training step                          -> training IR
2. `complex_pairs`: complex values become real pairs (rotary embeddings written with complex
   numbers); `portable_ops`: attention / layer_norm / rms_norm become `portable::` ops
3. decomposition to core ATen; for training AOT autograd's joint graph adds the backward
4. `build`: signature, weights and per-node source/shape metadata       -> Program
5. `training`: the optimizer update is traced and spliced in (training steps only)
6. the verifier checks the result against the opset
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.export.exported_program import ExportedProgram, _decompose_exported_program

from ..errors import CaptureError, PortableError, VerifyError
from ..ir.plan import Plan
from ..ir.program import Program, ProgramKind
from ..ir.signature import Signature
from ..ir.source import SourceLoc, from_fx_meta
from ..opset.bind import bind
from ..optim import AdamW, as_optimizer
from ..recipe import Precision, Recipe
from ..schedules import as_schedule
from ..torch_compat import quiet_internal_warnings
from ..verify import verify
from .abstract import abstract_state, is_abstract_model
from .accumulate import micro_batch, unroll
from .autocast import Autocast
from .build import annotate, to_program
from .complex_pairs import lower_complex
from .decompositions import decompositions, without_error_checks
from .decorator import ModelSpec, portable, spec_of
from .diagnose import diagnose, is_user_file, without_partial_graph
from .dropout import CounterDropout
from .known_constructs import explain, refuse_known_ops
from .layers import find_stack, repeat_layers, truncated
from .loss import as_loss_fn
from .portable_ops import rewrite_to_portable_ops
from .promote import promote_operands
from .recompose import recompose
from .regions import refuse_autocast
from .sources import restore_sources
from .tensors import check_tensors
from .training import add_optimizer

__all__ = ["ModelSpec", "capture", "capture_loss", "capture_spec", "portable", "spec_of"]

_WRAPPER_PREFIX = "model."


class _RngState(torch.nn.Module):
    """The dropout generator's key, program state `rng.seed` and `rng.offset` (int64, 0-d):
    the offset advances once per forward that draws (per micro-batch)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.register_buffer("seed", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("offset", torch.tensor(0, dtype=torch.int64))

    def key(self) -> tuple[torch.Tensor, torch.Tensor]:
        seed, offset = self.get_buffer("seed"), self.get_buffer("offset")
        return seed, offset


class _LossStep(torch.nn.Module):
    """forward(*batch) = loss_fn(model, *batch) / accumulate: what a training step
    differentiates (for one micro-batch), under the recipe's autocast policy, with dropout
    drawn from the program's counter-based generator."""

    def __init__(
        self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], recipe: Recipe
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.recipe = recipe
        self.rng = _RngState(recipe.seed)
        self.streams = 0  # random calls the last forward drew (CounterDropout)

    def forward(self, *batch: Any, **kwargs: Any) -> torch.Tensor:
        precision = self.recipe.precision
        autocast = Autocast(precision.compute_dtype) if precision.mixed else None
        seed, offset = self.rng.key()
        with autocast or contextlib.nullcontext():
            with CounterDropout(seed, offset) as dropout:
                loss = self.loss_fn(self.model, *batch, **kwargs)
        self.streams = dropout.streams
        if dropout.streams:
            offset.add_(1)
        n = self.recipe.accumulate
        return loss if n == 1 else loss / n


def capture(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] | Any,
    *,
    kwargs: dict[str, Any] | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    optimizer: Any = None,
    plan: Plan | None = None,
    dynamic_shapes: Any = None,
    name: str | None = None,
    schedule: Any = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    precision: Precision | None = None,
    accumulate: int = 1,
    remat: str = "none",
    seed: int = 0,
) -> Program:
    """Capture `model` into a Program.

    Without `loss_fn`: an inference program of `model(*example_inputs, **kwargs)` in eval mode.
    With `loss_fn` (and `optimizer`): a training-step program of one optimizer step on
    `loss_fn(model, *example_inputs, **kwargs)` in train mode; `example_inputs` is then the batch,
    and the recipe (`schedule`: a `portable.schedules` value or the torch lr_scheduler built on
    `optimizer`; `clip_grad_norm`/`clip_grad_value`; `precision`; `accumulate`: micro-batches
    along dim 0; `remat`: the remat pass's policy; `seed`: dropout's generator) is part of the
    program (portable/recipe.py, docs/training-recipe.md).
    The model itself is left unchanged (mode and buffers are restored).
    """
    if precision is not None and not isinstance(precision, Precision):
        raise CaptureError(
            f"precision must be a portable.Precision, got {type(precision).__name__}",
            fix='pass precision=portable.Precision(compute="bfloat16")',
        )
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(
            f"capture needs an nn.Module, got {type(model).__name__}",
            fix="pass the model instance (for a factory, call it first)",
        )
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    check_tensors(model, args, kwargs or {})
    name = name or type(model).__name__
    options = {"training": loss_fn is not None, "dynamic_shapes": dynamic_shapes is not None}
    accumulate = _pipeline_accumulate(plan, accumulate, loss_fn is not None)
    recipe_args = {
        "schedule": schedule,
        "clip_grad_norm": clip_grad_norm,
        "clip_grad_value": clip_grad_value,
        "precision": precision,
        "accumulate": accumulate,
        "remat": remat,
        "seed": seed,
    }
    try:
        with quiet_internal_warnings():
            program = _capture(
                model, args, kwargs, loss_fn, optimizer, dynamic_shapes, name, options, recipe_args
            )
        if plan is not None:
            plan.validate(program.tensor_shapes())
            program.plan = plan
        _verify(program)
    except CaptureError as exc:
        explained = explain(exc, model)  # a known construct's remedy (e.g. HF experts)
        if explained is exc:
            raise
        raise explained from exc
    return program


def _capture(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer: Any,
    dynamic_shapes: Any,
    name: str,
    options: dict[str, Any],
    recipe_args: dict[str, Any],
) -> Program:
    if loss_fn is None:
        given = [k for k, v in recipe_args.items() if v != _RECIPE_DEFAULTS[k]]
        if optimizer is not None or given:
            what = ", ".join(["optimizer"] * (optimizer is not None) + given)
            raise CaptureError(
                f"{what} given without loss_fn", fix="pass loss_fn=... for a training step"
            )
        with _mode(model, training=False):
            program = _repeated(
                model,
                args,
                kwargs,
                lambda: _capture_inference(model, args, kwargs, dynamic_shapes, name, options),
            )
    else:
        if optimizer is None:
            raise CaptureError(
                "a training step needs an optimizer", fix="pass optimizer=portable.optim.AdamW(...)"
            )
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        opt = as_optimizer(optimizer, trainable)
        recipe = _recipe(optimizer, recipe_args)
        loss_fn = as_loss_fn(loss_fn, args, kwargs or {})
        options["optimizer"] = opt.to_dict()

        def step() -> Program:
            joint = _capture_training(
                model, loss_fn, args, kwargs, dynamic_shapes, name, options, recipe
            )
            return add_optimizer(joint, opt, recipe)

        with _mode(model, training=True):
            program = _repeated(model, args, kwargs, step, opt.group_of)
        if recipe.remat != "none":
            # the one pass capture applies: the recipe names it (passes sit above capture)
            from ..passes import manager, remat

            pipeline = manager.PassManager([remat.Remat(policy=recipe.remat)])
            program, _ = pipeline.run(program)
    return program


def _repeated(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    capture_once: Callable[[], Program],
    group_of: Callable[[str], int] | None = None,
) -> Program:
    """`capture_once()`; for an abstract model with a deep stack of identical layers, from a
    capture of its first layers with the middle one repeated (capture/layers.py), unless the
    capture does not repeat."""
    stack = find_stack(model) if is_abstract_model(model, args, kwargs) else None
    if stack is None:
        return capture_once()
    with truncated(stack):
        short = capture_once()
    full = repeat_layers(short, stack, group_of)
    return full if full is not None else capture_once()


def _pipeline_accumulate(plan: Plan | None, accumulate: int, training: bool) -> int:
    """A pipeline's micro-batches are the step's accumulation: `accumulate` defaults to them,
    and any other count is refused (the pipelined step is the single-device step)."""
    if plan is None or plan.pipeline is None or not training:
        return accumulate
    m = plan.pipeline.microbatches
    if accumulate not in (1, m):
        raise CaptureError(
            f"accumulate={accumulate} but the plan's pipeline runs {m} micro-batches per step",
            fix=f"leave accumulate out (the pipeline sets it to {m}) or make them equal",
        )
    return m


_RECIPE_DEFAULTS: dict[str, Any] = {
    "schedule": None,
    "clip_grad_norm": None,
    "clip_grad_value": None,
    "precision": None,
    "accumulate": 1,
    "remat": "none",
    "seed": 0,
}


def _recipe(optimizer: Any, given: dict[str, Any]) -> Recipe:
    """The Recipe of capture's arguments; a torch scheduler must drive the optimizer given."""
    scheduler = given["schedule"]
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        if scheduler.optimizer is not optimizer:
            raise CaptureError(
                f"schedule={type(scheduler).__name__} drives another optimizer than the one "
                "passed as optimizer=",
                fix="build the scheduler on the optimizer you pass: "
                "schedule=LinearLR(optimizer, ...)",
            )
    elif isinstance(optimizer, torch.optim.Optimizer) and _has_scheduler(optimizer):
        raise CaptureError(
            f"a learning-rate scheduler is attached to {type(optimizer).__name__}, but none "
            "was passed: the program would train at a constant lr",
            fix="pass it too: portable.capture(..., optimizer=opt, schedule=scheduler)",
        )
    schedule, start = as_schedule(scheduler)
    return Recipe(
        schedule=None if scheduler is None else schedule,
        start=start,
        clip_grad_norm=given["clip_grad_norm"],
        clip_grad_value=given["clip_grad_value"],
        precision=given["precision"] or Precision(),
        accumulate=given["accumulate"],
        remat=given["remat"],
        seed=given["seed"],
    )


def _has_scheduler(optimizer: torch.optim.Optimizer) -> bool:
    # torch's LRScheduler wraps the optimizer's step and records each group's initial_lr
    return hasattr(optimizer.step, "_wrapped_by_lr_sched") or any(
        "initial_lr" in g for g in optimizer.param_groups
    )


class _Loss(torch.nn.Module):
    """forward(*batch) = loss_fn(model, *batch): a validation loss, without a backward."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, *batch)


def capture_loss(
    model: torch.nn.Module,
    batch: tuple[Any, ...],
    loss_fn: Callable[..., torch.Tensor],
    *,
    plan: Plan | None = None,
    name: str | None = None,
) -> Program:
    """The inference program of `loss_fn(model, *batch)` in eval mode (dropout off): what a
    training job's validation runs. Its state has the training step's weight keys
    (`blocks.0.attn.qkv.weight`), so it runs on the training state as it is."""
    args = tuple(batch)
    check_tensors(model, args, {})
    name = name or f"{type(model).__name__}.eval_loss"
    options = {"training": False, "dynamic_shapes": False}
    loss_fn = as_loss_fn(loss_fn, args, {})
    try:
        with quiet_internal_warnings(), _mode(model, training=False):
            program = _capture_inference(
                _Loss(model, loss_fn), args, None, None, name, options, _WRAPPER_PREFIX
            )
        if plan is not None:
            plan.validate(program.tensor_shapes())
            program.plan = plan
        _verify(program)
    except CaptureError as exc:
        explained = explain(exc, model)
        if explained is exc:
            raise
        raise explained from exc
    return program


def capture_spec(
    spec: ModelSpec | Any,
    *,
    training: bool = False,
    model: torch.nn.Module | None = None,
    plan: Plan | None = None,
) -> Program:
    """Capture a `@portable` model (the decorated class or factory, or its `ModelSpec`) with its
    recorded example inputs, loss and optimizer; `plan` replaces the spec's own."""
    spec = _spec(spec)
    if plan is not None:
        spec = dataclasses.replace(spec, plan=plan)
    model = model if model is not None else spec.build()
    if not training:
        return capture(
            model, spec.inputs(), plan=spec.plan, dynamic_shapes=spec.dynamic_shapes, name=spec.name
        )
    if not spec.trainable:
        raise CaptureError(
            f"`{spec.name}` has no loss_fn",
            fix="pass loss_fn=... and example_batch=... to @portable",
        )
    return capture(
        model,
        spec.batch(),
        loss_fn=spec.loss_fn,
        optimizer=spec.optimizer or _default_optimizer(),
        plan=spec.plan,
        name=f"{spec.name}.train_step",
        **spec.recipe,
    )


def _spec(obj: Any) -> ModelSpec:
    if isinstance(obj, ModelSpec):
        return obj
    spec = spec_of(obj)
    if spec is None:
        name = getattr(obj, "__qualname__", type(obj).__name__)
        raise CaptureError(
            f"capture_spec needs a @portable class or factory (or its ModelSpec); {name} is not "
            "decorated with @portable",
            fix="decorate it with @portable(example_inputs=...), or call "
            "portable.capture(model, example_inputs)",
        )
    return spec


def _default_optimizer() -> AdamW:
    return AdamW()


@contextlib.contextmanager
def _mode(model: torch.nn.Module, *, training: bool) -> Iterator[None]:
    """Set train/eval for capture; restore each submodule's mode afterwards."""
    modes = {m: m.training for m in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def _export(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    dynamic_shapes: Any,
    phase: str,
) -> ExportedProgram:
    abstract = abstract_state if is_abstract_model(module, args, kwargs) else _as_is
    try:
        with without_partial_graph(), abstract(module, args, kwargs) as (args, kwargs):
            return torch.export.export(
                module, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False
            )
    except PortableError:
        raise
    except Exception as exc:  # torch raises many types; all become a CaptureError with the cause
        raise diagnose(exc, phase=phase) from exc


@contextlib.contextmanager
def _as_is(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any] | None]]:
    yield args, kwargs


def _portable_ops(ep: ExportedProgram, strip_prefix: str) -> None:
    def source_of(node: torch.fx.Node) -> SourceLoc | None:
        return from_fx_meta(node.meta, is_user_file, strip_prefix)

    refuse_known_ops(ep.graph_module, source_of)
    lower_complex(ep, source_of)
    for gm in ep.graph_module.modules():  # with the bodies of torch.no_grad() & co. regions
        if isinstance(gm, torch.fx.GraphModule):
            rewrite_to_portable_ops(gm, source_of)


def _untie(ep: ExportedProgram, strip_prefix: str) -> tuple[ExportedProgram, dict[str, str]]:
    """Merge tied parameters (one tensor under several names, e.g. a GPT's embedding and LM
    head) into one input: the name the graph uses is kept, the others recorded as its aliases.
    Returns the new ExportedProgram and {dropped name: kept name}."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind

    sig = ep.graph_signature
    placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
    groups: dict[int, list] = {}
    for node, spec in zip(placeholders, sig.input_specs, strict=True):
        if spec.kind == InputKind.PARAMETER:
            groups.setdefault(id(ep.state_dict[spec.target]), []).append((node, spec))
    tied, drop = {}, set()
    for members in groups.values():
        if len(members) < 2:
            continue
        keep = max(members, key=lambda m: len(m[0].users))
        for node, spec in members:
            if node is keep[0]:
                continue
            node.replace_all_uses_with(keep[0])
            drop.add(node.name)
            tied[spec.target.removeprefix(strip_prefix)] = keep[1].target.removeprefix(strip_prefix)
    if not drop:
        return ep, {}
    for node in placeholders:
        if node.name in drop:
            ep.graph_module.graph.erase_node(node)
    ep.graph_module.recompile()
    specs = [s for n, s in zip(placeholders, sig.input_specs, strict=True) if n.name not in drop]
    new_sig = ExportGraphSignature(input_specs=specs, output_specs=list(sig.output_specs))
    return ep._update(ep.graph_module, new_sig), tied


def _capture_inference(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    dynamic_shapes: Any,
    name: str,
    options: dict[str, Any],
    strip_prefix: str = "",
) -> Program:
    ep = _export(model, args, kwargs, dynamic_shapes, "exporting the forward")
    refuse_autocast(ep.graph_module, strip_prefix)
    ep, tied = _untie(ep, strip_prefix)
    _portable_ops(ep, strip_prefix)
    try:
        with without_error_checks():
            ep = ep.run_decompositions(decompositions(python_only=False))
    except Exception as exc:
        raise diagnose(exc, phase="decomposing to core ATen") from exc
    _normalize(ep.graph_module)
    program = to_program(
        ep, ProgramKind.INFERENCE, name=name, strip_prefix=strip_prefix, options=options
    )
    program.metadata["tied_weights"] = tied
    return program


def _capture_training(
    model: torch.nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    dynamic_shapes: Any,
    name: str,
    options: dict[str, Any],
    recipe: Recipe,
) -> Program:
    step = _LossStep(model, loss_fn, recipe)
    if recipe.accumulate > 1:
        if kwargs or dynamic_shapes is not None:
            raise CaptureError(
                "accumulate > 1 with keyword batch inputs or dynamic shapes",
                fix="pass the batch positionally, with static shapes",
            )
        args = micro_batch(args, recipe.accumulate)
    ep = _export(step, args, kwargs, dynamic_shapes, "exporting the loss")
    refuse_autocast(ep.graph_module, _WRAPPER_PREFIX)
    _check_scalar_loss(ep)
    ep, tied = _untie(ep, _WRAPPER_PREFIX)
    _portable_ops(ep, _WRAPPER_PREFIX)
    try:
        with without_error_checks():
            # The forward alone, decomposed the same way: its nodes keep the user's source lines.
            forward = ep.run_decompositions(decompositions(python_only=False)).graph_module
            annotate(forward, _WRAPPER_PREFIX)
            try:
                ep = _joint(ep)
            except AssertionError as exc:
                if "gradients_to_parameters" not in str(exc):
                    raise
                ep = _joint(_distinct_gradients(ep))
                _drop_multiplications_by_one(ep.graph_module)
    except Exception as exc:
        raise diagnose(exc, phase="building the backward graph") from exc
    _normalize(forward)
    _normalize(ep.graph_module)
    restore_sources(ep.graph_module.graph, forward.graph)
    recompose(ep.graph_module)
    program = to_program(
        ep, ProgramKind.TRAINING_STEP, name=name, strip_prefix=_WRAPPER_PREFIX, options=options
    )
    program.metadata["tied_weights"] = tied
    if not step.streams:
        _drop_inputs(program, (RNG_SEED, RNG_OFFSET))  # no dropout: no generator state
    return unroll(program, recipe.accumulate)


RNG_SEED, RNG_OFFSET = "rng.seed", "rng.offset"


def _drop_inputs(program: Program, targets: tuple[str, ...]) -> None:
    """Remove unused state inputs (and weights) of these targets."""
    sig = program.signature
    drop = {i.name for i in sig.inputs if i.target in targets}
    for node in list(program.graph.nodes):
        if node.op == "placeholder" and node.name in drop and not node.users:
            program.graph.erase_node(node)
        elif node.op == "placeholder" and node.name in drop:
            drop.discard(node.name)
    program.graph_module.recompile()
    program.signature = Signature(tuple(i for i in sig.inputs if i.name not in drop), sig.outputs)
    kept = {i.target for i in program.signature.inputs}
    program.weights = {k: v for k, v in program.weights.items() if k not in targets or k in kept}


def _check_scalar_loss(ep: ExportedProgram) -> None:
    outs = [s for s in ep.graph_signature.output_specs if s.kind.name == "USER_OUTPUT"]
    vals = [n.meta.get("val") for n in ep.graph_module.graph.output_node().args[0]][-len(outs) :]
    if len(outs) != 1 or not isinstance(vals[0], torch.Tensor) or vals[0].dim() != 0:
        shape = [tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals]
        raise CaptureError(
            f"loss_fn must return one scalar tensor, got {shape}",
            fix="reduce the loss to a scalar (e.g. .mean()) and return only it",
        )
    if not vals[0].is_floating_point():
        raise CaptureError(f"loss has dtype {vals[0].dtype}", fix="return a floating-point loss")


_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
_RUNTIME_ASSERTS = (
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._linalg_check_errors.default,  # decompositions.without_error_checks
)


def _joint(ep: ExportedProgram) -> ExportedProgram:
    """The joint-graph path of torch.export (what torch.export.experimental's
    _export_forward_backward does), with core ATen decompositions."""
    return _decompose_exported_program(
        ep,
        cia_to_decomp={},
        python_decomp_table=decompositions(python_only=True),
        joint_loss_index=0,
        decompose_custom_triton_ops=False,
    )


def _distinct_gradients(ep: ExportedProgram) -> ExportedProgram:
    """`ep` with every parameter used through `p * 1`. AOT autograd's joint export keys the
    gradients by their node: two parameters whose gradient is the same node (`a + b`: both get
    the loss's gradient as is) collapse into one and the export fails its own count. `p * 1`
    gives each its own gradient node (`g * 1`); `_drop_multiplications_by_one` removes both
    multiplications afterwards (x * 1 is x exactly)."""
    graph = ep.graph_module.graph
    params = set(ep.graph_signature.inputs_to_parameters)
    for node in list(graph.nodes):
        if node.op != "placeholder" or node.name not in params:
            continue
        users = list(node.users)
        with graph.inserting_after(node):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (node, 1))
        scaled.meta = {k: v for k, v in node.meta.items() if k in ("val", "tensor_meta")}
        for user in users:
            user.replace_input_with(node, scaled)
    ep.graph_module.recompile()
    return ep


def _drop_multiplications_by_one(gm: torch.fx.GraphModule) -> None:
    """`mul(x, 1)` of a tensor to its own dtype is x, bit for bit (NaN, infinities and -0
    included)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.mul.Tensor:
            continue
        x, other = (list(node.args) + [None, None])[:2]
        if not isinstance(x, torch.fx.Node) or isinstance(other, torch.fx.Node) or other != 1:
            continue
        before, after = x.meta.get("val"), node.meta.get("val")
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor):
            if before.dtype == after.dtype and before.shape == after.shape:
                node.replace_all_uses_with(x)
                gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _normalize(gm: torch.fx.GraphModule) -> None:
    """Drop what only eager tracing needs: `detach`/`alias` (identities in a functional graph)
    and export's runtime metadata asserts (the verifier checks shapes and dtypes statically);
    `prims.convert_element_type` becomes the `_to_copy` it is."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.prims.convert_element_type.default:
            # what some core decompositions (renorm of bfloat16) leave: the cast it is
            x, dtype = node.args
            node.target, node.args, node.kwargs = (
                torch.ops.aten._to_copy.default,
                (x,),
                {"dtype": dtype},
            )
        elif node.target in _IDENTITIES:
            node.replace_all_uses_with(bind(node).node("self"))
            gm.graph.erase_node(node)
        elif node.target in _RUNTIME_ASSERTS and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    promote_operands(gm)


def _verify(program: Program) -> None:
    """Verify the captured program; what the model did that the opset refuses is a CaptureError."""
    try:
        verify(program)
    except VerifyError as exc:
        raise CaptureError(
            exc.what,
            op=exc.op,
            module=exc.module,
            source=exc.source,
            fix=exc.fix,
            details=exc.details,
        ) from exc
