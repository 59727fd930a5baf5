"""The tolerance policy of parity checks: how far a correct backend may be from the reference.

Every element of every compared quantity must satisfy (`compare.py` has the special values)

    |got - want| <= atol + rtol * |want| + allowance

with one `rtol` / `atol` for every kind of program (defaults `RTOL`, `ATOL`; `check_parity`,
`assert_parity` and `portable lower --parity` share them) and an `allowance` that the reference
measures on itself: what rounding alone can make of this program.

- **Spread.** The reference runs a second time from inputs perturbed at rounding level: every
  float weight and float input element multiplied by `1 + u * eps` (`u` uniform in [-1, 1],
  `eps` the dtype's machine epsilon, a fixed seed; `u = +-1` for float16 and bfloat16, so that
  every element moves by at least one ulp instead of rounding back to itself). A
  backward-stable implementation computes the exact result of inputs perturbed that much, so
  `SPREAD_FACTOR * |perturbed - reference|` is within rounding. This covers outputs and losses whose conditioning amplifies rounding.
- **Optimizer noise** (training steps). Both runs give each step's gradient (recovered from the
  optimizer state, `_gradient`); `delta_t = SPREAD_FACTOR * max |g'_t - g_t|` over all gradient
  elements of the model (at least one ulp of the largest gradient) bounds the rounding error of
  every gradient element at step t (0 for an element both runs give exactly 0: no term reaches
  it). The allowance of a parameter or optimizer-state element is the sum
  over steps of how far the optimizer's own update moves it when its gradient moves within
  `+-delta_t` (the update evaluated in float64 at the reference's state, at `ENVELOPE_POINTS`
  points of the interval). For SGD that is `lr * delta_t`, negligible. AdamW divides by the
  gradient's running RMS: an element whose gradient is within `delta_t` of zero (exactly zero in
  exact arithmetic: a key bias, which softmax ignores) takes a step of either sign of up to `lr`,
  and gets an allowance of about `lr` per step, while an element with a gradient above the noise
  keeps an allowance of rounding size. So a wrong update (another lr, bias correction, eps or
  weight decay) is still caught on every element whose gradient the program determines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from ..optim import SGD, Adam, Lion, Optimizer
from ..recipe import Recipe

__all__ = [
    "ATOL",
    "ENVELOPE_POINTS",
    "RTOL",
    "SPREAD_FACTOR",
    "OptimizerNoise",
    "perturbed",
    "spread_allowance",
]

RTOL = 1e-5
ATOL = 1e-6
SPREAD_FACTOR = 4.0
ENVELOPE_POINTS = 9
STEP_KEY = "optimizer.step"


def perturbed(
    values: Sequence[torch.Tensor],
    generator: torch.Generator,
    compute: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Each float tensor times `1 + u * eps` elementwise, others unchanged: u ~ U[-1, 1], and
    u = +-1 for a 16-bit dtype, whose rounding back would undo most smaller perturbations (its
    ulp is a large step: every element must move for each to get its allowance). `compute`: a
    16-bit dtype a mixed-precision program computes in; float32 values then move by its eps
    (they are rounded to it before use, which would undo a float32-sized perturbation)."""
    out = []
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            dtype = value.dtype
            if compute is not None and compute.itemsize == 2 and dtype == torch.float32:
                dtype = compute
            u = torch.rand(value.shape, generator=generator, dtype=torch.float64) * 2 - 1
            if dtype.itemsize == 2:
                u = torch.where(u < 0, -1.0, 1.0).to(u.dtype)
            eps = torch.finfo(dtype).eps
            value = (value.double() * (1 + u * eps).to(value.device)).to(value.dtype)
        out.append(value)
    return out


def spread_allowance(
    want: Mapping[str, torch.Tensor], other: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """SPREAD_FACTOR * |other - want| for every finite float quantity (0 at special values,
    which `compare` judges by their own rule)."""
    out = {}
    for key, w in want.items():
        o = other.get(key)
        if o is None or not w.is_floating_point() or o.shape != w.shape:
            continue
        diff = (o.double() - w.double()).abs()
        out[key] = SPREAD_FACTOR * torch.where(diff.isfinite(), diff, 0.0)
    return out


@dataclasses.dataclass
class OptimizerNoise:
    """The optimizer-noise allowance, accumulated step by step (module docstring).

    `params` are the state keys of the trained parameters (`fc1.weight`); the allowance is keyed
    like parity quantities (`state fc1.weight`, `state optimizer.fc1.weight.exp_avg`)."""

    optimizer: Optimizer
    params: Sequence[str]
    recipe: Recipe = dataclasses.field(default_factory=Recipe)
    allowance: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    deltas: list[float] = dataclasses.field(default_factory=list)

    def hyper(self, param: str, step: torch.Tensor) -> tuple[torch.Tensor, float]:
        """(lr, weight decay) of `param`'s group at this step (the recipe's schedule)."""
        base, weight_decay = self.optimizer.group_hyper(self.optimizer.group_of(param))
        t = torch.tensor(float(step) + self.recipe.start, dtype=torch.float64)
        schedule = self.recipe.schedule
        lr = schedule.lr(t, base) if schedule is not None else torch.tensor(base, dtype=t.dtype)
        return lr, weight_decay

    def add_step(
        self,
        before: Mapping[str, torch.Tensor],
        after: Mapping[str, torch.Tensor],
        other_before: Mapping[str, torch.Tensor],
        other_after: Mapping[str, torch.Tensor],
    ) -> None:
        """One step of the reference (`before` -> `after`) and of the perturbed run."""
        recovered = {p: _gradient(self, p, before, after) for p in self.params}
        recovered_other = {p: _gradient(self, p, other_before, other_after) for p in self.params}
        grads = {p: g for p, g in recovered.items() if g is not None}
        others = {p: g for p, g in recovered_other.items() if g is not None}
        if len(grads) != len(self.params) or len(others) != len(self.params):
            return  # no gradient recovery for this optimizer: the spread alone is allowed
        delta = _gradient_noise(grads, others, [before[p].dtype for p in self.params])
        self.deltas.append(delta)
        for p in self.params:
            # an element both runs give exactly 0 has no term (an embedding row no token uses)
            structural_zero = (grads[p] == 0) & (others[p] == 0)
            spread = torch.where(structural_zero, 0.0, torch.full_like(grads[p], delta))
            for key, moved in self._envelope(p, before, grads[p], spread).items():
                self.allowance[key] = self.allowance.get(key, 0) + moved

    def _envelope(
        self,
        param: str,
        before: Mapping[str, torch.Tensor],
        grad: torch.Tensor,
        delta: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """How far the update moves the parameter and each state when the gradient moves
        within +-delta elementwise (max over ENVELOPE_POINTS points of the interval)."""
        names = [k for k in self.optimizer.state_names if f"optimizer.{param}.{k}" in before]
        p = before[param].double()
        state = {k: before[f"optimizer.{param}.{k}"].double() for k in names}
        step = before[STEP_KEY]
        lr, wd = self.hyper(param, step)

        def update(g: torch.Tensor) -> list[torch.Tensor]:
            return _flat(self.optimizer.update(p, g, state, step, lr, wd), names)

        base = update(grad)
        moved = [torch.zeros_like(v) for v in base]
        for k in torch.linspace(-1, 1, ENVELOPE_POINTS).tolist():
            if k:
                shifted = update(grad + k * delta)
                moved = [
                    torch.maximum(m, (s - b).abs())
                    for m, s, b in zip(moved, shifted, base, strict=True)
                ]
        keys = [f"state {param}", *(f"state optimizer.{param}.{k}" for k in names)]
        return dict(zip(keys, moved, strict=True))


def _flat(
    update: tuple[torch.Tensor, dict[str, torch.Tensor]], names: Sequence[str]
) -> list[torch.Tensor]:
    param, state = update
    return [param, *(state[k] for k in names)]


def _gradient_noise(
    grads: Mapping[str, torch.Tensor],
    others: Mapping[str, torch.Tensor],
    dtypes: Sequence[torch.dtype],
) -> float:
    """SPREAD_FACTOR * the largest gradient difference between the two runs over the whole
    model, at least one ulp (of the coarsest parameter dtype) of the largest gradient. Model-wide
    because a gradient that cancels to ~0 has the rounding error of its terms, which are of the
    model's gradient scale, not of its own size (a key bias's terms are those of the query bias)."""
    sizes = [float(g.abs().max()) for g in grads.values() if g.numel()]
    spreads = [float((grads[p] - others[p]).abs().max()) for p in grads if grads[p].numel()]
    if not sizes:
        return 0.0
    ulp = max(torch.finfo(d).eps for d in dtypes) * max(sizes)
    return SPREAD_FACTOR * max(max(spreads), ulp)


def _gradient(
    noise: OptimizerNoise,
    param: str,
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
) -> torch.Tensor | None:
    """The gradient step `before` -> `after` consumed, recovered in float64 from the state
    (None for an optimizer whose state does not give it back: Adafactor): Adam's exp_avg is
    lerp(exp_avg, g, 1 - beta1) (Adam's L2 decay adds weight_decay * param to g first), Lion's
    beta2 * m + (1 - beta2) * g; SGD's momentum buffer is g on the first step, then
    momentum * buf + (1 - dampening) * g; plain SGD moves the parameter by lr * g (SGD adds
    weight_decay * param to g first). The lr and weight decay are the parameter's group's."""
    optimizer = noise.optimizer
    state = f"optimizer.{param}."
    lr, weight_decay = noise.hyper(param, before[STEP_KEY])
    p0 = before[param].double()
    if isinstance(optimizer, Adam):
        m0, m1 = before[state + "exp_avg"].double(), after[state + "exp_avg"].double()
        g = m0 + (m1 - m0) / (1 - optimizer.betas[0])
        return g if optimizer.decoupled else g - weight_decay * p0
    if isinstance(optimizer, Lion):
        m0, m1 = before[state + "exp_avg"].double(), after[state + "exp_avg"].double()
        return (m1 - optimizer.betas[1] * m0) / (1 - optimizer.betas[1])
    if isinstance(optimizer, SGD):
        if optimizer.momentum == 0:
            g = (p0 - after[param].double()) / float(lr)
        elif float(before[STEP_KEY]) == 0:
            g = after[state + "momentum_buffer"].double()
        elif optimizer.dampening == 1:  # the buffer no longer takes the gradient
            return torch.zeros_like(p0)
        else:
            b0 = before[state + "momentum_buffer"].double()
            b1 = after[state + "momentum_buffer"].double()
            g = (b1 - optimizer.momentum * b0) / (1 - optimizer.dampening)
        return g - weight_decay * p0
    return None
