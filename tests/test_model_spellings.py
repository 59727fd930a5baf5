"""The spellings real models write that failed for a missing op before opset 1.3 (log1p, sign,
flip, expm1, rounding): softplus, logsigmoid, mish, BCE-with-logits, logaddexp, and the training
steps of abs, l1/smooth-l1 losses, softsign and cumsum, whose backward ops need sign and flip,
and of replicate padding.
Each runs on `cpu` against eager and on `xla` and `onnx` against `cpu` (inference), and its
training step on `cpu` and `xla` against eager `torch.optim.SGD`."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.testing import check_parity

pytest.importorskip("jax")
pytest.importorskip("onnxruntime")


class _Head(nn.Module):
    """A linear layer then `act`: the spelling under test sits where a model has it."""

    def __init__(self, act) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.proj(x))


_SPELLINGS = {
    "softplus": F.softplus,
    "softplus_beta": lambda h: F.softplus(h, beta=2.0, threshold=5.0),
    "logsigmoid": F.logsigmoid,
    "mish": F.mish,
    "nn.Mish": nn.Mish(),
    "softsign": F.softsign,
    "logaddexp": lambda h: torch.logaddexp(h, h.flip(-1)),
    "expm1_log1p": lambda h: torch.expm1(h.tanh()) + torch.log1p(h.abs()),
    "round_floor": lambda h: torch.round(h * 4) / 4 + torch.floor(h) + torch.trunc(h),
    "sign": lambda h: torch.sign(h) * h,
    "cumsum_rev": lambda h: h.flip(-1).cumsum(-1).flip(-1),
    "log2_log10": lambda h: torch.log2(h.exp()) + torch.log10(h.exp()),
}


def _inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),)


@pytest.mark.parametrize("name", sorted(_SPELLINGS))
def test_inference_on_every_backend(name):
    torch.manual_seed(0)
    model = _Head(_SPELLINGS[name]).eval()
    inputs = _inputs()
    program = portable.capture(model, inputs)
    torch.testing.assert_close(portable.compile(program, backend="cpu")(*inputs), model(*inputs))
    report = check_parity(program, inputs, backends=["xla", "onnx"])
    assert report.ok, report.format()


_LOSSES = {
    "abs": lambda out, y: (out - y).abs().mean(),
    "l1_loss": F.l1_loss,
    "smooth_l1_loss": F.smooth_l1_loss,
    "huber_loss": lambda out, y: F.huber_loss(out, y, delta=0.5),
    "bce_with_logits": lambda out, y: F.binary_cross_entropy_with_logits(out, y.sigmoid()),
    "softplus": lambda out, y: F.softplus(out - y).mean(),
    "mish": lambda out, y: (F.mish(out) * y).mean(),
    "softsign": lambda out, y: (F.softsign(out) * y).mean(),
    "cumsum": lambda out, y: (out.cumsum(-1) * y).mean(),
    # replicate padding (ESRGAN-style conv nets, causal convs): the backward sums each edge's
    # copies into it (replication_pad*_backward, decomposed at capture)
    "replicate_pad1d": lambda out, y: (
        F.pad(out.unsqueeze(1), (3, 2), mode="replicate") * F.pad(y.unsqueeze(1), (3, 2), value=1)
    ).mean(),
    "replicate_pad2d": lambda out, y: (
        F.pad(out.view(1, 4, 8), (1, 2, 2, 1), mode="replicate")
        * F.pad(y.view(1, 4, 8), (1, 2, 2, 1), mode="reflect")
    ).mean(),
}


@pytest.mark.parametrize("name", sorted(_LOSSES))
def test_training_step_matches_eager(name):
    torch.manual_seed(0)
    model = _Head(nn.Identity())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    criterion = _LOSSES[name]

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return criterion(m(x), y)

    program = portable.capture(model, (x, y), loss_fn=loss_fn, optimizer=portable.optim.SGD(lr=0.1))
    report = check_parity(
        program, (x, y), backends=["xla"], eager_model=model, loss_fn=loss_fn, steps=2
    )
    assert report.ok, report.format()
