"""Calling a compiled program with inputs that do not fit it."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from torch.export import Dim

import portable

from .base import OK, Scenario, refused, wrong

_cache: dict[str, object] = {}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y


def _run() -> portable.Executable:
    """A program with a dynamic batch dim shared by both inputs, compiled on cpu."""
    if "run" not in _cache:
        torch.manual_seed(0)
        batch = Dim("batch", min=2, max=16)
        program = portable.capture(
            _Net(),
            (torch.randn(4, 4), torch.randn(4, 3)),
            dynamic_shapes=({0: batch}, {0: batch}),
        )
        _cache["run"] = portable.compile(program, backend="cpu")
    return _cache["run"]  # type: ignore[return-value]


def _call(*inputs):
    return lambda tmp: refused(lambda: _run()(*inputs))


def nan_input(tmp: Path) -> str:
    """NaN in, NaN out: not an error, and no garbage either."""
    x = torch.full((4, 4), float("nan"))
    out = _run()(x, torch.zeros(4, 3))
    return OK if bool(out.isnan().all()) else wrong("NaN input gave finite output")


SCENARIOS = [
    Scenario("too few inputs", "runtime", _call(torch.randn(4, 4))),
    Scenario("wrong dtype", "runtime", _call(torch.randn(4, 4).half(), torch.randn(4, 3))),
    Scenario("wrong rank", "runtime", _call(torch.randn(4), torch.randn(4, 3))),
    Scenario("wrong static dim", "runtime", _call(torch.randn(4, 5), torch.randn(4, 3))),
    Scenario("dynamic dim out of range", "runtime", _call(torch.randn(40, 4), torch.randn(40, 3))),
    Scenario("one dynamic dim, two sizes", "runtime", _call(torch.randn(4, 4), torch.randn(5, 3))),
    Scenario("not a tensor", "runtime", _call([[1.0] * 4] * 4, torch.randn(4, 3))),
    Scenario("sparse input", "runtime", _call(torch.randn(4, 4).to_sparse(), torch.randn(4, 3))),
    Scenario(
        "meta input",
        "runtime",
        _call(torch.randn(4, 4, device="meta"), torch.randn(4, 3)),
    ),
    Scenario("NaN input", "runtime", nan_input, expect="works"),
]
