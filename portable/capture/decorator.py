"""`@portable`: attach capture defaults to a model class or factory.

The decorator returns the object unchanged apart from a `__portable__` attribute holding a
`ModelSpec`. The CLI finds models by that attribute (`file.py:Name`, `pkg.module:Name`), so there is
no global registry to mutate at import time.

    @portable(
        example_inputs=lambda: (torch.randn(8, 32),),
        loss_fn=lambda model, x, y: F.mse_loss(model(x), y),
        example_batch=lambda: (torch.randn(8, 32), torch.randn(8, 4)),
        optimizer=portable.optim.AdamW(lr=1e-3),
    )
    class MLP(nn.Module): ...
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CaptureError, PortableError
from ..optim import Optimizer
from ..recipe import Precision, Recipe
from ..schedules import Schedule
from .diagnose import user_code_failed

__all__ = ["ModelSpec", "portable", "spec_of"]

Inputs = tuple[Any, ...]


def _materialize(value: Callable[[], Inputs] | Inputs | None) -> Inputs | None:
    if value is None:
        return None
    out = value() if callable(value) else value
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What `@portable` records: how to build the model and what to capture it with.

    `example_inputs` feed `model(*inputs)`; `example_batch` feeds `loss_fn(model, *batch)`.
    Both may be callables (evaluated under a fixed seed) or tuples.
    """

    target: Any
    name: str
    example_inputs: Callable[[], Inputs] | Inputs | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    example_batch: Callable[[], Inputs] | Inputs | None = None
    optimizer: Optimizer | None = None
    plan: Any = None
    dynamic_shapes: Any = None
    seed: int = 0
    recipe: dict[str, Any] = dataclasses.field(default_factory=dict)  # capture's recipe args

    @property
    def trainable(self) -> bool:
        return self.loss_fn is not None

    def build(self) -> torch.nn.Module:
        """Instantiate the model under `seed` so every build has the same weights."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self._call(self.target, f"building `{self.name}`", _BUILD_FIX)
        if not isinstance(model, torch.nn.Module):
            raise CaptureError(
                f"`{self.name}` built a {type(model).__name__}, not a torch.nn.Module",
                fix="decorate an nn.Module class or a function that returns an nn.Module",
            )
        return model

    def inputs(self) -> Inputs:
        return self._seeded(self.example_inputs, "example_inputs", offset=1)

    def batch(self) -> Inputs:
        return self._seeded(self.example_batch, "example_batch", offset=2)

    def _seeded(
        self, value: Callable[[], Inputs] | Inputs | None, field: str, offset: int
    ) -> Inputs:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + offset)
            out = self._call(
                lambda: _materialize(value),
                f"{field} of `{self.name}`",
                f"fix the {field} function (it takes no arguments and returns a tuple of tensors)",
            )
        if out is None:
            raise CaptureError(
                f"`{self.name}` has no {field}",
                fix=f"pass {field}=... to @portable",
            )
        return out

    @staticmethod
    def _call(fn: Callable[[], Any], what: str, fix: str) -> Any:
        """fn(); an exception from the user's code becomes a CaptureError at the user's line."""
        try:
            return fn()
        except PortableError:
            raise
        except Exception as exc:  # the user's factory may raise anything
            raise user_code_failed(what, exc, fix=fix) from exc


_BUILD_FIX = (
    "fix the error at that line; a @portable class is constructed with no arguments (give its "
    "parameters defaults, or decorate a zero-argument factory instead)"
)


def portable(
    target: Any = None,
    *,
    example_inputs: Callable[[], Inputs] | Inputs | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    example_batch: Callable[[], Inputs] | Inputs | None = None,
    optimizer: Optimizer | None = None,
    plan: Any = None,
    dynamic_shapes: Any = None,
    name: str | None = None,
    seed: int = 0,
    schedule: Any = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    precision: Any = None,
    accumulate: int = 1,
    remat: str = "none",
) -> Any:  # the decorated object itself, or (called with options only) the decorator
    """Mark an `nn.Module` class (constructible with no arguments) or a zero-argument factory
    as a portable model. Usable bare (`@portable`) or with arguments (`@portable(...)`).
    The training recipe (`schedule`: a `portable.schedules` value, `clip_grad_norm`,
    `clip_grad_value`, `precision`, `accumulate`, `remat`) is what `portable.capture` takes; it
    is checked here, at decoration."""
    recipe_args = {
        "schedule": schedule,
        "clip_grad_norm": clip_grad_norm,
        "clip_grad_value": clip_grad_value,
        "precision": precision,
        "accumulate": accumulate,
        "remat": remat,
    }
    _check_recipe(recipe_args)

    def wrap(obj: Any) -> Any:
        if not callable(obj):
            raise CaptureError(
                f"@portable needs a class or a function, got {type(obj).__name__}",
                fix="decorate an nn.Module subclass or a zero-argument model factory",
            )
        if inspect.isclass(obj) and not issubclass(obj, torch.nn.Module):
            raise CaptureError(
                f"@portable class `{obj.__qualname__}` is not an nn.Module",
                fix="subclass torch.nn.Module",
            )
        if loss_fn is not None and example_batch is None:
            raise CaptureError(
                f"`{obj.__qualname__}` has loss_fn but no example_batch",
                fix="pass example_batch=lambda: (inputs..., targets...) to @portable",
            )
        obj.__portable__ = ModelSpec(
            target=obj,
            name=name or obj.__qualname__,
            example_inputs=example_inputs,
            loss_fn=loss_fn,
            example_batch=example_batch,
            optimizer=optimizer,
            plan=plan,
            dynamic_shapes=dynamic_shapes,
            seed=seed,
            recipe={k: v for k, v in recipe_args.items() if v is not None},
        )
        return obj

    return wrap(target) if target is not None else wrap


def _check_recipe(args: dict[str, Any]) -> None:
    """The recipe's own checks (portable.recipe.Recipe), at decoration time."""
    schedule = args["schedule"]
    if schedule is not None and not isinstance(schedule, Schedule):
        raise CaptureError(
            f"@portable(schedule=...) takes a portable.schedules value, got "
            f"{type(schedule).__name__}",
            fix="use portable.schedules.* (a torch lr_scheduler needs the optimizer instance: "
            "pass it to portable.capture instead)",
        )
    precision = args["precision"]
    if precision is not None and not isinstance(precision, Precision):
        raise CaptureError(
            f"precision must be a portable.Precision, got {type(precision).__name__}",
            fix='pass precision=portable.Precision(compute="bfloat16")',
        )
    Recipe(
        schedule=schedule,
        clip_grad_norm=args["clip_grad_norm"],
        clip_grad_value=args["clip_grad_value"],
        precision=precision or Precision(),
        accumulate=args["accumulate"],
        remat=args["remat"],
    )  # the seed argument of @portable seeds the model's weights; dropout's is capture's


def spec_of(obj: Any) -> ModelSpec | None:
    """The `ModelSpec` of a decorated object, or None."""
    spec = getattr(obj, "__portable__", None)
    return spec if isinstance(spec, ModelSpec) else None
