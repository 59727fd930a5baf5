"""Optimizers as data, with a functional update that is traced into the training-step graph.

Each optimizer is a frozen dataclass of hyper-parameters and parameter groups, plus two functions
over plain tensors: `init_state(param)` creates a parameter's state, and
`update(param, grad, state, step, lr, weight_decay)` returns the new parameter and state. `step`
is a 0-d float32 tensor counting completed updates (0 on the first), `lr` the group's scheduled
learning rate as a 0-d float64 tensor, `weight_decay` the group's as a Python float.

`update` mirrors `torch.optim`'s default single-tensor (for-loop, non-capturable) step op for op,
so that running it eagerly on float32 tensors gives the parameters of `torch.optim.<X>.step()` bit
for bit: scalars that torch computes as Python floats (bias corrections, step sizes, the lr
itself) are computed here in float64 tensors and enter each kernel as the kernel would convert
its Python scalar (`_mul`, `_div`, `_add_scaled`, `_addcdiv`, `_lerp` below). Two limits of that
emulation: `tensor.add(other, alpha=x)` and `lerp` are one fused multiply-add in ATen, emulated
in float64, which for float32 rounds as the fused op except with probability about 2**-29 per
element (a double rounding); for float64 parameters there is no wider type and those two ops
may differ by one ulp. For float16 / bfloat16 parameters, `add(alpha=x)` follows ATen's
vectorized loop, not its scalar loop over a tensor's last few elements (`_add_scaled`).

Optimizers: `SGD`, `Adam` (L2 weight decay added to the gradient), `AdamW` (decoupled decay),
both with `amsgrad`; `Adafactor` (`torch.optim.Adafactor`: factored second moments for >= 2-D
parameters); `Lion` (Chen et al. 2023, no `torch.optim` equivalent).

Parameter groups: `groups=(ParamGroup(...), ...)`, first match wins, unmatched parameters form the
default group with the optimizer's own `lr` and `weight_decay`. The usual recipe, no weight decay
for biases, norms and embeddings:

    AdamW(lr=3e-4, weight_decay=0.1, groups=no_decay_groups())
    # = groups=(ParamGroup(pattern=r"(bias|norm|ln_|embed|wte|wpe)", weight_decay=0.0),)

`from_torch` reads a fresh `torch.optim` optimizer (every group becomes a `ParamGroup` of exact
names); `to_torch` builds the eager equivalent; `Optimizer.from_dict` reads the untrusted record
an archive holds.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from .errors import CaptureError, PlanError
from .ir.safe_regex import SafePattern, compile_pattern

__all__ = [
    "NO_DECAY_PATTERN",
    "SGD",
    "Adafactor",
    "Adam",
    "AdamW",
    "Lion",
    "Optimizer",
    "ParamGroup",
    "as_optimizer",
    "from_torch",
    "no_decay_groups",
    "to_torch",
]

NO_DECAY_PATTERN = r"(bias|norm|ln_|embed|wte|wpe)"

# --- hyper-parameter checks (also what `from_dict` relies on for untrusted records) -------------

Check = Callable[[str, Any], Any]  # (label such as "AdamW(lr)", value) -> normalized value


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits has no repr
        return f"<a {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(label: str, value: Any, requirement: str) -> CaptureError:
    return CaptureError(
        f"{label[:-1]}={_shown(value)}) is not {requirement}",
        fix=f"pass {label.split('(')[-1][:-1]}= as {requirement}",
    )


def _real(low: float = 0.0, high: float = math.inf, *, below: bool = False) -> Check:
    """A finite Python number in [low, high] (or [low, high) with `below`), made a float."""
    top = ")" if below else "]"
    requirement = f"a finite number in [{low:g}, {high:g}{top}"

    def check(label: str, value: Any) -> float:
        number = _as_float(value)
        if number is None or not math.isfinite(number) or not low <= number <= high:
            raise _bad(label, value, requirement)
        if below and number == high:
            raise _bad(label, value, requirement)
        return number

    return check


def _as_float(value: Any) -> float | None:
    """A Python int or float (not a bool) as a float; None for anything else or too large."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond float range (JSON allows 4300 digits)
        return None


def _flag(label: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(label, value, "True or False")
    return value


def _pair(item: Check) -> Check:
    def check(label: str, value: Any) -> tuple[Any, Any]:
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise _bad(label, value, "a pair of values")
        return (item(label, value[0]), item(label, value[1]))

    return check


def _optional(item: Check) -> Check:
    def check(label: str, value: Any) -> Any:
        return None if value is None else item(label, value)

    return check


def _hyper(default: Any, check: Check) -> Any:
    """A dataclass field whose value `__post_init__` checks (and normalizes) with `check`."""
    return dataclasses.field(default=default, metadata={"check": check})


def _check_fields(obj: Any) -> None:
    for f in dataclasses.fields(obj):
        check = f.metadata.get("check")
        if check is not None:
            label = f"{type(obj).__name__}({f.name})"
            object.__setattr__(obj, f.name, check(label, getattr(obj, f.name)))


def _fields_from(cls: type, data: Any, what: str, skip: str = "") -> dict[str, Any]:
    """The keyword arguments of `cls` in an untrusted mapping (less the key `skip`): unknown
    keys are refused."""
    if not isinstance(data, Mapping):
        raise CaptureError(
            f"{what} is not a mapping but {type(data).__name__}",
            fix=f"write it as {{field: value}} with {cls.__name__}'s fields",
        )
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(_shown(k) for k in data if k not in known and k != skip)
    if unknown:
        raise CaptureError(
            f"{what} has unknown field(s) {', '.join(unknown)}",
            fix=f"{cls.__name__} takes {', '.join(sorted(known))}",
        )
    return {k: v for k, v in data.items() if k != skip}


# --- parameter groups ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Parameters that share a base lr and weight decay: those whose name (`fc1.bias`) the
    regex `pattern` finds (`re.search`, matched in linear time: no backreferences, lookarounds or
    flags), or those listed in `names`. `lr` is the group's absolute base lr; without it the
    group runs at the optimizer's lr times `lr_scale`. `weight_decay` None: the optimizer's."""

    pattern: str | None = None
    names: tuple[str, ...] = ()
    lr: float | None = _hyper(None, _optional(_real()))
    lr_scale: float = _hyper(1.0, _real())
    weight_decay: float | None = _hyper(None, _optional(_real()))
    _search: SafePattern | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    _names: frozenset[str] = dataclasses.field(
        default=frozenset(), init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        _check_fields(self)
        names = self.names
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
            raise _bad("ParamGroup(names)", names, "a tuple of non-empty parameter names")
        object.__setattr__(self, "names", tuple(names))
        object.__setattr__(self, "_names", frozenset(names))
        if (self.pattern is None) == (not names):
            raise CaptureError(
                "a ParamGroup selects parameters by pattern or by names, "
                f"got {'both' if names else 'neither'}",
                fix="ParamGroup(pattern=r'(bias|norm)', ...) or ParamGroup(names=('fc.bias',), ...)",
            )
        if self.lr is not None and self.lr_scale != 1.0:
            raise CaptureError(
                f"ParamGroup(lr={self.lr:g}, lr_scale={self.lr_scale:g}) gives the group's lr twice",
                fix="pass lr= (absolute) or lr_scale= (times the optimizer's lr), not both",
            )
        if self.pattern is not None:
            object.__setattr__(self, "_search", _search_pattern(self.pattern))

    def matches(self, name: str) -> bool:
        if self._search is not None:
            return self._search.fullmatch(name)
        return name in self._names

    def to_dict(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "names": list(self.names),
            "lr": self.lr,
            "lr_scale": self.lr_scale,
            "weight_decay": self.weight_decay,
        }

    @staticmethod
    def from_dict(data: Any) -> ParamGroup:
        return ParamGroup(**_fields_from(ParamGroup, data, "a parameter group record"))


def _search_pattern(pattern: Any) -> SafePattern:
    """`re.search(pattern, name)` as a linear-time whole-name match of `[\\s\\S]*(?:p)[\\s\\S]*`
    (the pattern is first compiled alone, so it cannot close the group it is wrapped in)."""
    if not isinstance(pattern, str):
        raise _bad("ParamGroup(pattern)", pattern, "a regular expression string")
    try:
        compile_pattern(pattern)
        return compile_pattern(rf"[\s\S]*(?:{pattern})[\s\S]*")
    except PlanError as exc:
        raise CaptureError(
            f"ParamGroup(pattern={_shown(pattern)}) is not a pattern portable matches safely",
            details=exc.what,
            fix="write a plain regular expression over parameter names, e.g. "
            r"r'(bias|norm)' or r'^blocks\.\d+\.attn\.' (no backreferences, lookarounds or flags)",
        ) from None


def no_decay_groups(
    weight_decay: float = 0.0, *, pattern: str = NO_DECAY_PATTERN
) -> tuple[ParamGroup, ...]:
    """The usual group of parameters without weight decay (biases, norms, embeddings), for
    `groups=`: the parameters `pattern` finds get `weight_decay`, the others the optimizer's."""
    return (ParamGroup(pattern=pattern, weight_decay=weight_decay),)


# --- kernel mirrors: a torch op with a Python-float scalar, given that scalar as a float64 tensor


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """ATen's opmath type: float16 and bfloat16 kernels compute in float32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _f64(value: float) -> Tensor:
    return torch.full((), value, dtype=torch.float64)


def _pow(base: Tensor | float, exponent: Tensor | float) -> Tensor:
    """`base ** exponent` as Python computes it on floats (C `pow`), in float64. A tensor
    exponent, because ATen computes `pow(x, 0.5)` as `sqrt(x)`, which rounds differently."""
    b = base if isinstance(base, Tensor) else _f64(base)
    e = exponent if isinstance(exponent, Tensor) else _f64(exponent)
    return torch.pow(b, e)


def _mul(x: Tensor, factor: Tensor) -> Tensor:
    """`x.mul(float)`: the factor rounded once to opmath, the product rounded to x's dtype."""
    op = _opmath(x.dtype)
    return (x.to(op) * factor.to(op)).to(x.dtype)


def _div(x: Tensor, divisor: Tensor) -> Tensor:
    """`x.div(float)`, as `_mul`."""
    op = _opmath(x.dtype)
    return (x.to(op) / divisor.to(op)).to(x.dtype)


def _fma(a: Tensor, b: Tensor, c: Tensor, dtype: torch.dtype) -> Tensor:
    """a * b + c rounded once to `dtype` (ATen's vec::fmadd), for a, b, c in `dtype`: the
    product of two floats is exact in float64 and the sum rounds there first (module docstring)."""
    if dtype == torch.float64:
        return a * b + c
    return (a.double() * b.double() + c.double()).to(dtype)


def _add_scaled(x: Tensor, y: Tensor, alpha: Tensor) -> Tensor:
    """`x.add(y, alpha=float)`: alpha rounded to x's dtype, then fmadd(y, alpha, x) in opmath.
    That is ATen's vectorized loop; for float16 / bfloat16 its scalar loop over the remainder
    (the last numel % 64 elements or fewer) computes y * alpha and the sum in the low dtype."""
    op = _opmath(x.dtype)
    a = alpha.to(x.dtype).to(op)
    return _fma(y.to(op), a, x.to(op), op).to(x.dtype)


def _addcdiv(x: Tensor, t1: Tensor, t2: Tensor, value: Tensor) -> Tensor:
    """`x.addcdiv(t1, t2, value=float)`: x + value * t1 / t2 in opmath, rounded op by op."""
    op = _opmath(x.dtype)
    return (x.to(op) + value.to(op) * t1.to(op) / t2.to(op)).to(x.dtype)


def _lerp(start: Tensor, end: Tensor, weight: Tensor) -> Tensor:
    """`start.lerp(end, float)`: ATen's lerp_vec, with w the weight in opmath,
    fmadd(w, end - start, start) when |w| < 0.5, else fmadd(w - 1, end - start, end)."""
    op = _opmath(start.dtype)
    s, e, w = start.to(op), end.to(op), weight.to(op)
    small = w.abs() < 0.5
    coeff = torch.where(small, w, w - 1)
    return _fma(coeff, e - s, torch.where(small, s, e), op).to(start.dtype)


# --- the optimizers -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Optimizer(abc.ABC):
    """Base: subclasses define `kind`, the fields `lr` and `weight_decay` (the default group's),
    `state_names`, and `_update` (the step for one parameter with its group's lr and decay)."""

    kind: ClassVar[str] = "optimizer"
    groups: tuple[ParamGroup, ...] = dataclasses.field(default=(), kw_only=True)

    @property
    @abc.abstractmethod
    def lr(self) -> float:
        """The default group's base learning rate."""

    @property
    @abc.abstractmethod
    def weight_decay(self) -> float:
        """The default group's weight decay."""

    def __post_init__(self) -> None:
        _check_fields(self)
        groups = self.groups
        if not isinstance(groups, list | tuple) or not all(
            isinstance(g, ParamGroup) for g in groups
        ):
            raise _bad(f"{type(self).__name__}(groups)", groups, "a tuple of ParamGroup")
        object.__setattr__(self, "groups", tuple(groups))

    def group_of(self, name: str) -> int:
        """0 for the default group, i + 1 for `groups[i]`, the first that matches `name`."""
        return next((i + 1 for i, g in enumerate(self.groups) if g.matches(name)), 0)

    def group_hyper(self, index: int) -> tuple[float, float]:
        """(base lr, weight decay) of group `index` (as `group_of` numbers them)."""
        if not 0 <= index <= len(self.groups):
            raise CaptureError(
                f"{type(self).__name__} has no parameter group {index}",
                fix=f"use 0 (the default group) to {len(self.groups)}",
            )
        if index == 0:
            return self.lr, self.weight_decay
        group = self.groups[index - 1]
        lr = group.lr if group.lr is not None else self.lr * group.lr_scale
        decay = group.weight_decay if group.weight_decay is not None else self.weight_decay
        return lr, decay

    @property
    def state_names(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors, in graph order (those a parameter has are
        the keys of `init_state(param)`, in this order)."""
        return ()

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        return {name: torch.zeros_like(param) for name in self.state_names}

    def update(
        self,
        param: Tensor,
        grad: Tensor,
        state: Mapping[str, Tensor],
        step: Tensor,
        lr: Tensor | float | None = None,
        weight_decay: float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The new parameter and state (same keys as `state`) after one step. `lr` and
        `weight_decay` default to the default group's. No Python branch on a tensor value, so
        `make_fx(tracing_mode="fake")` traces it."""
        lr = self.lr if lr is None else lr
        lr_t = (lr if isinstance(lr, Tensor) else _f64(lr)).to(torch.float64)
        decay = self.weight_decay if weight_decay is None else float(weight_decay)
        return self._update(param, grad, dict(state), step, lr_t, decay)

    @abc.abstractmethod
    def _update(
        self,
        param: Tensor,
        grad: Tensor,
        state: dict[str, Tensor],
        step: Tensor,
        lr: Tensor,
        weight_decay: float,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["groups"] = [g.to_dict() for g in self.groups]
        return out

    @staticmethod
    def from_dict(data: Any) -> Optimizer:
        """The optimizer a record describes (untrusted: every field is checked; records written
        before parameter groups, `{"kind": "adamw", "lr": ..., "betas": [...], ...}`, load)."""
        kind = data.get("kind") if isinstance(data, Mapping) else None
        cls = _KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise CaptureError(
                f"unknown optimizer kind {_shown(kind)}", fix=f"use one of {', '.join(_KINDS)}"
            )
        kwargs = _fields_from(cls, data, f"the {kind} optimizer record", skip="kind")
        groups = kwargs.get("groups", [])
        if not isinstance(groups, list | tuple):
            raise _bad(f"{cls.__name__}(groups)", groups, "a list of parameter groups")
        kwargs["groups"] = tuple(ParamGroup.from_dict(g) for g in groups)
        return cls(**kwargs)


def _first_step_or(step: Tensor, first: Tensor, later: Tensor) -> Tensor:
    return torch.where(step == 0, first, later)


@dataclasses.dataclass(frozen=True)
class SGD(Optimizer):
    """`torch.optim.SGD` (the momentum buffer starts as the first gradient)."""

    kind: ClassVar[str] = "sgd"
    lr: float = _hyper(1e-2, _real())
    momentum: float = _hyper(0.0, _real())
    dampening: float = _hyper(0.0, _real())
    weight_decay: float = _hyper(0.0, _real())
    nesterov: bool = _hyper(False, _flag)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise CaptureError(
                "SGD nesterov needs momentum > 0 and dampening == 0",
                fix=f"got momentum={self.momentum}, dampening={self.dampening}",
            )

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",) if self.momentum != 0 else ()

    def _update(self, param, grad, state, step, lr, weight_decay):
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        new_state = {}
        if self.momentum != 0:
            later = state["momentum_buffer"].mul(self.momentum).add(grad, alpha=1 - self.dampening)
            buf = _first_step_or(step, grad, later)
            new_state["momentum_buffer"] = buf
            grad = grad.add(buf, alpha=self.momentum) if self.nesterov else buf
        return _add_scaled(param, grad, -lr), new_state


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """`torch.optim.Adam`: weight decay as L2 added to the gradient (`AdamW`: decoupled)."""

    kind: ClassVar[str] = "adam"
    decoupled: ClassVar[bool] = False
    lr: float = _hyper(1e-3, _real())
    betas: tuple[float, float] = _hyper((0.9, 0.999), _pair(_real(0.0, 1.0, below=True)))
    eps: float = _hyper(1e-8, _real())
    weight_decay: float = _hyper(0.0, _real())
    amsgrad: bool = _hyper(False, _flag)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.amsgrad else ())

    def _update(self, param, grad, state, step, lr, weight_decay):
        beta1, beta2 = self.betas
        if weight_decay != 0 and self.decoupled:
            param = _mul(param, 1 - lr * weight_decay)
        elif weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        exp_avg = state["exp_avg"].lerp(grad, 1 - beta1)
        exp_avg_sq = state["exp_avg_sq"].mul(beta2).addcmul(grad, grad, value=1 - beta2)
        new_state = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        second = exp_avg_sq
        if self.amsgrad:
            second = new_state["max_exp_avg_sq"] = torch.maximum(state["max_exp_avg_sq"], second)
        t = (step + 1).to(torch.float64)  # torch: step_t += 1, then its value as a Python float
        step_size = lr / (1 - _pow(beta1, t))
        bias_correction2_sqrt = _pow(1 - _pow(beta2, t), 0.5)
        denom = _div(second.sqrt(), bias_correction2_sqrt).add(self.eps)
        return _addcdiv(param, exp_avg, denom, -step_size), new_state


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """`torch.optim.AdamW` (= `Adam(decoupled_weight_decay=True)`): param *= 1 - lr * wd."""

    kind: ClassVar[str] = "adamw"
    decoupled: ClassVar[bool] = True
    weight_decay: float = _hyper(1e-2, _real())


@dataclasses.dataclass(frozen=True)
class Adafactor(Optimizer):
    """`torch.optim.Adafactor`: for a >= 2-D parameter, row and column means of g**2 over its
    last two dims (`row_var` [..., n, 1], `col_var` [..., 1, m]); otherwise a full `variance`.
    beta2 decays as 1 - t**beta2_decay; the relative step min(lr, 1/sqrt(t)) is scaled by
    max(eps[1], RMS(param)); the update is clipped to RMS d. `eps[0]` None: the dtype's eps."""

    kind: ClassVar[str] = "adafactor"
    lr: float = _hyper(1e-2, _real())
    beta2_decay: float = _hyper(-0.8, _real(-math.inf, 0.0))
    eps: tuple[float | None, float] = _hyper((None, 1e-3), _pair(_optional(_real())))
    d: float = _hyper(1.0, _real(1.0))
    weight_decay: float = _hyper(0.0, _real())

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.eps[1] is None:
            raise _bad("Adafactor(eps)", self.eps, "a pair (eps1 or None, eps2)")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("row_var", "col_var", "variance")

    def init_state(self, param: Tensor) -> dict[str, Tensor]:
        if param.dim() < 2:
            return {"variance": torch.zeros_like(param)}
        rows, cols = list(param.shape), list(param.shape)
        rows[-1], cols[-2] = 1, 1
        return {"row_var": param.new_zeros(rows), "col_var": param.new_zeros(cols)}

    def _update(self, param, grad, state, step, lr, weight_decay):
        eps1 = torch.finfo(param.dtype).eps if self.eps[0] is None else self.eps[0]
        eps2 = float(self.eps[1])
        t = (step + 1).to(torch.float64)
        one_minus_beta2 = _pow(t, self.beta2_decay)
        rho = torch.minimum(lr, 1 / _pow(t, 0.5))
        rms = torch.linalg.vector_norm(param).to(torch.float64) / param.numel() ** 0.5
        alpha = rms.clamp_min(eps2) * rho
        if weight_decay != 0:
            param = _mul(param, 1 - lr * weight_decay)
        new_state, var_estimate = self._second_moment(grad, state, one_minus_beta2, eps1)
        update = var_estimate.clamp_min(eps1 * eps1).rsqrt().mul(grad)
        update_rms = torch.linalg.vector_norm(update).to(torch.float64)
        denom = (update_rms / (update.numel() ** 0.5 * self.d)).clamp_min(1.0)
        return _add_scaled(param, update, -alpha / denom), new_state

    @staticmethod
    def _second_moment(
        grad: Tensor, state: dict[str, Tensor], weight: Tensor, eps1: float
    ) -> tuple[dict[str, Tensor], Tensor]:
        """(new state, the variance estimate) as torch's single-tensor Adafactor."""
        if grad.dim() < 2:
            variance = _lerp(state["variance"], grad * grad, weight)
            return {"variance": variance}, variance
        row_mean = torch.norm(grad, dim=-1, keepdim=True).square().div(grad.size(-1))
        row_var = _lerp(state["row_var"], row_mean, weight)
        col_mean = torch.norm(grad, dim=-2, keepdim=True).square().div(grad.size(-2))
        col_var = _lerp(state["col_var"], col_mean, weight)
        estimate = (row_var @ col_var).div(row_var.mean(dim=-2, keepdim=True).clamp_min(eps1))
        return {"row_var": row_var, "col_var": col_var}, estimate


@dataclasses.dataclass(frozen=True)
class Lion(Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2):
    c = beta1 * m + (1 - beta1) * g; p = p * (1 - lr * wd) - lr * sign(c);
    m = beta2 * m + (1 - beta2) * g. No `torch.optim` equivalent (`to_torch` gives an eager one
    running this update)."""

    kind: ClassVar[str] = "lion"
    lr: float = _hyper(1e-4, _real())
    betas: tuple[float, float] = _hyper((0.9, 0.99), _pair(_real(0.0, 1.0)))
    weight_decay: float = _hyper(0.0, _real())

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg",)

    def _update(self, param, grad, state, step, lr, weight_decay):
        beta1, beta2 = self.betas
        m = state["exp_avg"]
        c = beta1 * m + (1 - beta1) * grad
        param = _mul(param, 1 - lr * weight_decay) - _mul(torch.sign(c), lr)
        return param, {"exp_avg": beta2 * m + (1 - beta2) * grad}


_KINDS: dict[str, type[Optimizer]] = {cls.kind: cls for cls in (SGD, Adam, AdamW, Adafactor, Lion)}


# --- torch.optim ---------------------------------------------------------------------------------


class _Eager(torch.optim.Optimizer):
    """The eager `torch.optim.Optimizer` of a portable optimizer without a `torch.optim` class
    (Lion): each step runs `portable.update` on every parameter with its group's lr and weight
    decay; the state holds `init_state(param)` and a float32 `step`, as torch's optimizers do."""

    def __init__(self, params: Any, portable: Optimizer) -> None:
        super().__init__(params, {"lr": portable.lr, "weight_decay": portable.weight_decay})
        self.portable = portable

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = _f64(float(group["lr"]))
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, lr, float(group["weight_decay"]))
        return loss

    def _step_one(self, param: Tensor, lr: Tensor, weight_decay: float) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state.update(self.portable.init_state(param))
        tensors = {k: v for k, v in state.items() if k != "step"}
        grad = typing.cast(Tensor, param.grad)  # step() skips parameters without one
        new, new_state = self.portable.update(param, grad, tensors, state["step"], lr, weight_decay)
        param.copy_(new)
        state.update(new_state)
        state["step"] += 1


def to_torch(
    optimizer: Optimizer, params: Mapping[str, Tensor] | Iterable[Tensor]
) -> torch.optim.Optimizer:
    """The eager optimizer taking the same steps (`torch.optim`'s for-loop implementation; for
    Lion, `update` run eagerly), with one torch parameter group per portable group. `params`:
    the model's trainable parameters by name (needed when the optimizer has groups)."""
    groups = _torch_groups(optimizer, params)
    if isinstance(optimizer, Lion):
        return _Eager(groups, optimizer)
    cls, kwargs = _torch_class(optimizer)
    return cls(groups, **kwargs)


def _torch_class(optimizer: Optimizer) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch.optim class and its hyper-parameters other than lr and weight_decay."""
    if isinstance(optimizer, SGD):
        return torch.optim.SGD, {
            "momentum": optimizer.momentum,
            "dampening": optimizer.dampening,
            "nesterov": optimizer.nesterov,
            "foreach": False,
        }
    if isinstance(optimizer, Adam):
        cls = torch.optim.AdamW if optimizer.decoupled else torch.optim.Adam
        kwargs = {"betas": optimizer.betas, "eps": optimizer.eps, "amsgrad": optimizer.amsgrad}
        return cls, {**kwargs, "foreach": False}
    if isinstance(optimizer, Adafactor):
        kwargs = {"beta2_decay": optimizer.beta2_decay, "eps": optimizer.eps, "d": optimizer.d}
        return torch.optim.Adafactor, {**kwargs, "foreach": False}
    raise CaptureError(f"no torch.optim equivalent for {type(optimizer).__name__}")


def _torch_groups(
    optimizer: Optimizer, params: Mapping[str, Tensor] | Iterable[Tensor]
) -> list[dict[str, Any]]:
    """torch parameter groups (params, lr, weight_decay), in `group_of` order, none empty."""
    if not isinstance(params, Mapping):
        if optimizer.groups:
            raise CaptureError(
                f"{type(optimizer).__name__} has {len(optimizer.groups)} parameter group(s), "
                "which match parameter names, and to_torch was given unnamed tensors",
                fix="pass the named parameters: to_torch(opt, dict(model.named_parameters()))",
            )
        params = {str(i): p for i, p in enumerate(params)}
    members: dict[int, list[Tensor]] = {}
    for name, param in params.items():
        members.setdefault(optimizer.group_of(name), []).append(param)
    out = []
    for index in sorted(members):
        lr, decay = optimizer.group_hyper(index)
        out.append({"params": members[index], "lr": lr, "weight_decay": decay})
    return out


def from_torch(
    optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor] | None = None
) -> Optimizer:
    """The portable optimizer that takes exactly the steps of a fresh `torch.optim.SGD` /
    `Adam` / `AdamW` / `Adafactor` (or `to_torch`'s eager Lion).

    Every torch parameter group becomes a `ParamGroup(names=..., lr=..., weight_decay=...)`
    (names from `params`, the model's trainable parameters, by tensor identity); the first
    group's lr and weight decay are the optimizer's. A group's lr is its base lr: with an lr
    scheduler attached, `group["initial_lr"]` (the schedule is the caller's to pass on). What a
    captured step cannot reproduce is refused by name, never dropped: groups that differ in
    other hyper-parameters, state from earlier steps, step hooks, `maximize`, implementation
    flags that round differently, and an optimizer over other tensors than `params`."""
    name = type(optimizer).__name__
    make, hyper = _reader(optimizer, name)
    _refuse_what_is_not_captured(optimizer, name)
    if params is not None:
        _check_covers(optimizer, name, params)
    groups = optimizer.param_groups
    for group in groups:
        _refuse_flags(group, name, type(optimizer))
    shared = [hyper(group) for group in groups]
    differ = sorted(k for k in shared[0] if any(s[k] != shared[0][k] for s in shared[1:]))
    if differ:
        raise CaptureError(
            f"{name}'s parameter groups differ in {', '.join(differ)}: portable parameter "
            "groups differ only in lr and weight_decay",
            fix=f"give every group the same {', '.join(differ)}",
        )
    kwargs = {
        "lr": _base_lr(groups[0]),
        "weight_decay": float(groups[0]["weight_decay"]),
        "groups": _groups_from(optimizer, name, params),
        **shared[0],
    }
    return make(groups)(**kwargs)


Reader = Callable[[dict[str, Any]], dict[str, Any]]


def _reader(
    optimizer: torch.optim.Optimizer, name: str
) -> tuple[Callable[[list[dict[str, Any]]], type[Optimizer]], Reader]:
    """(the portable class for the torch groups, a group's other hyper-parameters)."""
    kind = type(optimizer)
    if kind is torch.optim.SGD:
        return lambda _: SGD, _sgd_hyper
    if kind in (torch.optim.Adam, torch.optim.AdamW):
        return _adam_class, _adam_hyper
    if kind is torch.optim.Adafactor:
        return lambda _: Adafactor, _adafactor_hyper
    if isinstance(optimizer, _Eager):
        portable = optimizer.portable
        other = {
            f.name: getattr(portable, f.name)
            for f in dataclasses.fields(portable)
            if f.name not in ("lr", "weight_decay", "groups")
        }
        return lambda _: type(portable), lambda _: other
    raise CaptureError(
        f"optimizer {name} is not supported",
        fix="use torch.optim.SGD / Adam / AdamW / Adafactor or portable.optim.SGD / Adam / "
        "AdamW / Adafactor / Lion",
    )


def _sgd_hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {
        "momentum": float(group["momentum"]),
        "dampening": float(group["dampening"]),
        "nesterov": bool(group["nesterov"]),
    }


def _adam_hyper(group: dict[str, Any]) -> dict[str, Any]:
    betas = (float(group["betas"][0]), float(group["betas"][1]))
    return {"betas": betas, "eps": float(group["eps"]), "amsgrad": bool(group["amsgrad"])}


def _adam_class(groups: list[dict[str, Any]]) -> type[Adam]:
    """AdamW for torch AdamW and Adam(decoupled_weight_decay=True); Adam's L2 decay otherwise,
    except that Adam without weight decay is AdamW(weight_decay=0), which takes the same steps."""
    flags = {bool(g.get("decoupled_weight_decay")) for g in groups}
    if len(flags) > 1:
        raise CaptureError(
            "Adam's parameter groups differ in decoupled_weight_decay: portable parameter "
            "groups differ only in lr and weight_decay",
            fix="give every group the same decoupled_weight_decay",
        )
    decoupled = flags == {True}
    coupled_decay = any(float(g["weight_decay"]) != 0 for g in groups)
    return Adam if coupled_decay and not decoupled else AdamW


def _adafactor_hyper(group: dict[str, Any]) -> dict[str, Any]:
    eps1, eps2 = group["eps"]
    return {
        "beta2_decay": float(group["beta2_decay"]),
        "eps": (None if eps1 is None else float(eps1), float(eps2)),
        "d": float(group["d"]),
    }


def _base_lr(group: dict[str, Any]) -> float:
    # an attached LRScheduler records each group's initial_lr and has already set group["lr"]
    return float(group.get("initial_lr", group["lr"]))


def _groups_from(
    optimizer: torch.optim.Optimizer, name: str, params: Mapping[str, Tensor] | None
) -> tuple[ParamGroup, ...]:
    groups = optimizer.param_groups
    if len(groups) == 1:
        return ()
    if params is None:
        raise CaptureError(
            f"{name} has {len(groups)} parameter groups; naming their parameters needs the model's",
            fix="pass params=dict(model.named_parameters()) (portable.capture does)",
        )
    names = {id(p): n for n, p in params.items()}
    out = []
    for group in groups:
        held = tuple(names[id(p)] for p in group["params"] if id(p) in names)
        if held:  # a group of frozen parameters only takes no step
            lr, decay = _base_lr(group), float(group["weight_decay"])
            out.append(ParamGroup(names=held, lr=lr, weight_decay=decay))
    return tuple(out)


# flags that change how torch computes a step: (flag, optimizer classes for which the flag on CPU
# gives the for-loop's bits (tests/test_optim.py checks each), why it is refused otherwise)
_FLAGS: tuple[tuple[str, tuple[type, ...], str], ...] = (
    (
        "foreach",
        (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW),
        "multiplies the update by its step size before adding it (the for-loop fuses the two)",
    ),
    ("fused", (), "computes the step in one kernel that rounds differently"),
    ("capturable", (), "computes bias corrections from the float32 step tensor"),
    (
        "differentiable",
        (torch.optim.SGD,),
        "computes bias corrections from the float32 step tensor",
    ),
)


def _refuse_flags(group: dict[str, Any], name: str, kind: type) -> None:
    if group.get("maximize"):
        raise CaptureError(
            f"{name}(maximize=True) is not supported",
            fix="minimize the negated objective (return -objective from loss_fn)",
        )
    for flag, exact, why in _FLAGS:
        if group.get(flag) and kind not in exact:
            raise CaptureError(
                f"{name}({flag}=True) {why}, so a captured step could not match it",
                fix=f"create it with {flag}=False (the default for-loop implementation)",
            )


def _refuse_what_is_not_captured(optimizer: torch.optim.Optimizer, name: str) -> None:
    if optimizer.state:
        raise CaptureError(
            f"{name} has state from earlier steps ({len(optimizer.state)} parameters); a "
            "captured step starts from fresh optimizer state",
            fix=f"pass a fresh {name} (created over model.parameters(), never stepped)",
        )
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        raise CaptureError(
            f"{name} has step hooks, which a captured step does not run",
            fix="remove the hooks (handle.remove()) and do that work outside the program",
        )


def _check_covers(
    optimizer: torch.optim.Optimizer, name: str, params: Mapping[str, Tensor]
) -> None:
    # tensors that do not require grad never get a gradient, so torch.optim skips them too
    held = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    missing = [n for n, p in params.items() if id(p) not in held]
    foreign = len(held - {id(p) for p in params.values()})
    if missing or foreign:
        listed = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise CaptureError(
            f"{name} holds {len(params) - len(missing)} of the model's {len(params)} trainable "
            "parameters"
            + (f" (not: {listed})" if missing else "")
            + (f" and {foreign} other tensor(s)" if foreign else "")
            + "; a captured step updates every trainable parameter of the model",
            fix="create it over model.parameters(), or freeze the others with "
            "param.requires_grad_(False) before capture",
        )


def as_optimizer(obj: Any, params: Mapping[str, Tensor] | None = None) -> Optimizer:
    """Accept a portable optimizer or a torch one (read by `from_torch`, checked against the
    model's trainable `params` when given). A learning-rate scheduler is refused by name: it is
    passed separately."""
    if isinstance(obj, Optimizer):
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        return from_torch(obj, params)
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        raise CaptureError(
            f"{type(obj).__name__} is a learning-rate scheduler, not an optimizer",
            fix="pass its optimizer as optimizer= and the scheduler as schedule= "
            "(portable.capture(..., optimizer=opt, schedule=scheduler))",
        )
    raise CaptureError(
        "optimizer must be a portable.optim optimizer (SGD, Adam, AdamW, Adafactor, Lion) or a "
        f"torch.optim one, got {type(obj).__name__}",
        fix="pass optimizer=portable.optim.AdamW(lr=...)",
    )
