"""When a result of the OpInfo sweep (tests/support/opinfo.py) agrees with its reference.

- `same`: bit for bit, NaN where the reference has NaN; shapes and dtypes equal.
- `close`: within `torch.testing.assert_close`'s defaults for the dtype, OpInfo's own
  starting tolerance (what `cpu` against eager may be beside `bit`).
- `same_up_to_ties`: an unstable sort's or topk's results, whose indices of equal elements
  torch leaves in no specified order.
- `mismatch`: a one-line account of how two results differ, for the sweep's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["close", "mismatch", "same", "same_up_to_ties", "tie_input"]

# torch.testing.assert_close's defaults: the tolerance OpInfo's own tests start from
_CLOSE = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}


def same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and torch.equal(x, y)
        or (
            x.shape == y.shape
            and x.dtype == y.dtype
            and x.is_floating_point()
            and bool(((x == y) | (x.isnan() & y.isnan())).all())
        )
        for x, y in zip(a, b, strict=True)
    )


def close(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        if g.shape != w.shape or g.dtype != w.dtype:
            return False
        rtol, atol = _CLOSE.get(w.dtype, (0.0, 0.0))
        if w.is_complex():
            rtol, atol = 1.3e-6, 1e-5
        try:
            torch.testing.assertclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            return False
    return True


# ops whose indices of equal elements are in no specified order (torch.sort's stable=False):
# which of their results are such indices
TIE_ORDERED = {"sort": (1,), "argsort": (0,), "msort": (), "topk": (1,)}


def tie_input(info: Any, sample: Any) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The input whose ties may be ordered freely and the index results, for an unstable sort
    or topk sample."""
    stable = sample.kwargs.get("stable", False)
    if info.name not in TIE_ORDERED or stable or not isinstance(sample.input, torch.Tensor):
        return None
    return sample.input, TIE_ORDERED[info.name]


def same_up_to_ties(
    ties: tuple[torch.Tensor, tuple[int, ...]],
    got: Sequence[torch.Tensor],
    want: Sequence[torch.Tensor],
) -> bool:
    """Every result but the index ones equal exactly; each index result distinct along some dim
    d of the input and selecting the same values as the reference's (`x.gather(d, .)`): only
    the order among equal elements may differ. Nothing else is accepted."""
    x, indices = ties
    if len(got) != len(want) or not x.dim():
        return False
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i not in indices:
            if not same((g,), (w,)):
                return False
        elif g.shape != w.shape or g.dtype != w.dtype:
            return False
        elif not any(selects_alike(x, g, w, d) for d in range(x.dim())):
            return False
    return True


def selects_alike(x: torch.Tensor, got: torch.Tensor, want: torch.Tensor, dim: int) -> bool:
    if got.dim() != x.dim() or any(
        a != b for i, (a, b) in enumerate(zip(got.shape, x.shape, strict=True)) if i != dim
    ):
        return False
    if bool(((got < 0) | (got >= x.shape[dim])).any()):
        return False
    ordered = got.sort(dim=dim).values
    if got.shape[dim] > 1 and bool((ordered.diff(dim=dim) == 0).any()):
        return False  # an element taken twice
    return same((x.gather(dim, got),), (x.gather(dim, want),))


def mismatch(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> str:
    parts = []
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g.shape != w.shape or g.dtype != w.dtype:
            parts.append(f"output {i}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
        elif g.is_floating_point():
            parts.append(
                f"output {i}: max abs {(g.double() - w.double()).abs().nan_to_num(0).max():.3g}"
            )
        else:
            parts.append(f"output {i}: {int((g != w).sum())} elements differ")
    return "; ".join(parts)[:300]
