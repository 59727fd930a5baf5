"""Elementwise comparison of one result against the reference, special values included.

A float element of `got` agrees with the reference element `want` when

    both are NaN, or both are the same infinity, or
    both are finite and |got - want| <= atol + rtol * |want| + allowance (+ ulp)

(`allowance`: an optional per-element widening, see `tolerance.py`; `ulp`: for a float16 or
bfloat16 result only, the spacing of that dtype at |want|, the result's final rounding: two
correct implementations round float32 values that differ in their last float32 bits, or in how
a Python scalar operand is held, and land one 16-bit step apart). Anything else disagrees: NaN
against a number, an infinity against the other infinity or a finite value. A complex element
agrees when its real and its imaginary part both agree by that rule, with `|want|` the complex
magnitude. Integer and bool tensors must be equal. Shapes and dtypes must be equal.

The errors reported are the elements' |got - want| (0 for agreeing NaNs and infinities, inf for
a disagreeing special value) and |got - want| / |want| (where the reference is finite and
nonzero; inf for a disagreeing special value; 0 elsewhere), so no NaN ever appears in a report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["ParityRow", "compare"]


@dataclasses.dataclass(frozen=True)
class ParityRow:
    backend: str
    quantity: str  # "output 0", "loss step 2", "state fc1.weight", ...
    max_abs: float
    max_rel: float
    first_mismatch: tuple[int, ...] | None  # index of the first element out of tolerance
    ok: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Errors:
    """Per element: whether it agrees, |got - want| and |got - want| / |want| (see
    `_relative`)."""

    agree: torch.Tensor
    abs: torch.Tensor
    rel: torch.Tensor
    within: torch.Tensor  # agrees without the allowance


def compare(
    backend: str,
    quantity: str,
    got: torch.Tensor,
    want: torch.Tensor,
    rtol: float,
    atol: float,
    allowance: torch.Tensor | None = None,
) -> ParityRow:
    """One row of a parity report (module docstring: the rule); a result on another device
    (cuda) is compared on the reference's device."""
    got = got.to(want.device)
    if got.shape != want.shape or got.dtype != want.dtype:
        note = f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
        return ParityRow(backend, quantity, float("inf"), float("inf"), None, False, note)
    if want.is_complex():
        errors = _complex_errors(got, want, rtol, atol, allowance)
    elif want.is_floating_point():
        if want.element_size() == 2:
            allowance = _ulp(want) if allowance is None else allowance + _ulp(want)
        errors = _float_errors(got.double(), want.double(), rtol, atol, allowance, want.abs())
    else:
        errors = _exact_errors(got, want)
    first = _first_disagreement(errors.agree)
    widened = int((errors.agree & ~errors.within).sum())
    note = f"{widened} element(s) within the rounding allowance only" if widened else ""
    return ParityRow(
        backend, quantity, _max(errors.abs), _max(errors.rel), first, first is None, note
    )


def _float_errors(
    got: torch.Tensor,
    want: torch.Tensor,
    rtol: float,
    atol: float,
    allowance: torch.Tensor | None,
    magnitude: torch.Tensor,
) -> _Errors:
    """`got`, `want` in float64; `magnitude` is |want| (the complex magnitude for a part)."""
    magnitude = magnitude.double()
    finite = got.isfinite() & want.isfinite()
    same_special = (got.isnan() & want.isnan()) | (got.isinf() & (got == want))
    diff = torch.where(finite, (got - want).abs(), torch.full_like(got, float("inf")))
    diff = torch.where(same_special, torch.zeros_like(diff), diff)
    bound = atol + rtol * magnitude
    within = same_special | (finite & (diff <= bound))
    agree = within
    if allowance is not None:
        agree = within | (finite & (diff <= bound + allowance.to(bound.device, torch.float64)))
    return _Errors(agree, diff, _relative(diff, magnitude), within)


def _ulp(want: torch.Tensor) -> torch.Tensor:
    """float64 spacing of `want`'s dtype at |want| (the subnormal spacing at zero)."""
    info = torch.finfo(want.dtype)
    smallest = info.smallest_normal * info.eps
    magnitude = want.double().abs()
    _, exponent = torch.frexp(torch.where(magnitude > 0, magnitude, 1.0))
    spacing = torch.ldexp(torch.full_like(magnitude, info.eps), exponent - 1)
    return torch.where(magnitude > 0, spacing, smallest).clamp_min(smallest)


def _complex_errors(
    got: torch.Tensor,
    want: torch.Tensor,
    rtol: float,
    atol: float,
    allowance: torch.Tensor | None,
) -> _Errors:
    """Both parts by the float rule, each against atol + rtol * |want| (complex magnitude)."""
    g = torch.view_as_real(got.resolve_conj()).double()
    w = torch.view_as_real(want.resolve_conj()).double()
    magnitude = want.abs().double().unsqueeze(-1).expand_as(w)
    # a part that is inf or NaN makes |want| so; the finite other part then scales with itself
    magnitude = torch.where(magnitude.isfinite(), magnitude, w.abs())
    if allowance is not None:
        allowance = allowance.unsqueeze(-1).expand_as(w)
    parts = _float_errors(g, w, rtol, atol, allowance, magnitude)
    return _Errors(
        parts.agree.all(dim=-1),
        parts.abs.amax(dim=-1),
        parts.rel.amax(dim=-1),
        parts.within.all(dim=-1),
    )


def _exact_errors(got: torch.Tensor, want: torch.Tensor) -> _Errors:
    """Integer and bool tensors: equal or not; errors as float64 for the report."""
    g, w = got.long(), want.long()
    diff = torch.where(g >= w, g - w, w - g).double()  # exact in int64, then for the report
    equal = got == want
    return _Errors(equal, diff, _relative(diff, w.double().abs()), equal)


def _relative(diff: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """diff / |want| where |want| is finite and nonzero; inf where diff is (a wrong special
    value); 0 elsewhere (an error at a zero reference has no relative size)."""
    defined = magnitude.isfinite() & (magnitude > 0)
    rel = torch.where(defined, diff / torch.where(defined, magnitude, 1.0), 0.0)
    return torch.where(diff.isinf(), float("inf"), rel)


def _first_disagreement(agree: torch.Tensor) -> tuple[int, ...] | None:
    if bool(agree.all()):
        return None
    flat = int((~agree).flatten().nonzero()[0])
    if agree.dim() == 0:
        return ()
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), agree.shape))


def _max(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0
