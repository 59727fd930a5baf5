"""Group norm, interpolation, adaptive max and 3-d pooling, diagonal and repeat in the models that
use them: a conv block with nn.GroupNorm, a UNet up block (F.interpolate bilinear and nearest),
nn.AdaptiveMaxPool2d, a 3-d conv net (MaxPool3d, AvgPool3d, AdaptiveAvgPool3d), torch.diagonal
and Tensor.repeat. Each is captured with the ops kept whole, runs bit for bit as eager on `cpu`,
agrees on `xla` and `onnx` under check_parity's policy, and trains: the training step captures
(with the backward ops the joint graph keeps) and matches eager PyTorch and `xla`."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import portable
from portable.errors import LoweringError
from portable.testing import check_parity

pytest.importorskip("jax")


class GroupNormBlock(nn.Module):
    def __init__(self, affine: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(4, 8, affine=affine)

    def forward(self, x):
        return F.silu(self.norm(self.conv(x)))


class UpBlock(nn.Module):
    """A UNet decoder step: upsample, concatenate the skip, convolve."""

    def __init__(self, mode: str, align_corners: bool | None = None):
        super().__init__()
        self.mode, self.align_corners = mode, align_corners
        self.conv = nn.Conv2d(6, 4, 3, padding=1)

    def forward(self, x, skip):
        up = F.interpolate(x, scale_factor=2, mode=self.mode, align_corners=self.align_corners)
        return self.conv(torch.cat([up, skip], dim=1))


class Resize(nn.Module):
    """F.interpolate to a fixed size (half-pixel or corner-aligned), then a 1x1 conv."""

    def __init__(self, mode: str, size, align_corners: bool | None = None):
        super().__init__()
        self.mode, self.size, self.align_corners = mode, size, align_corners
        self.proj = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = F.interpolate(x, size=self.size, mode=self.mode, align_corners=self.align_corners)
        return self.proj(y)


class AdaptiveMaxHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.pool = nn.AdaptiveMaxPool2d((3, 2))
        self.fc = nn.Linear(24, 5)

    def forward(self, x):
        return self.fc(self.pool(self.conv(x)).flatten(1))


class Conv3dNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv3d(2, 4, 3, padding=1)
        self.max = nn.MaxPool3d(2)
        self.conv2 = nn.Conv3d(4, 4, 3, padding=1)
        self.avg = nn.AvgPool3d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.head = nn.AdaptiveAvgPool3d((1, 2, 1))
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        x = self.max(F.relu(self.conv1(x)))
        x = self.avg(F.relu(self.conv2(x)))
        return self.fc(self.head(x).flatten(1))


class DiagonalRepeat(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.proj(x) @ x.transpose(-1, -2)  # [b, n, n]
        diag = torch.diagonal(scores, offset=0, dim1=-2, dim2=-1)  # [b, n]
        return diag.repeat(1, 3) + x.sum(-1).repeat(1, 3)


def _image(*shape):
    return (torch.randn(*shape),)


MODELS = {
    "group_norm": (GroupNormBlock, lambda: _image(2, 3, 6, 6)),
    "group_norm_no_affine": (lambda: GroupNormBlock(affine=False), lambda: _image(2, 3, 5, 4)),
    "up_bilinear": (lambda: UpBlock("bilinear"), lambda: _image(2, 4, 5, 6) + _image(2, 2, 10, 12)),
    "up_bilinear_corners": (
        lambda: UpBlock("bilinear", align_corners=True),
        lambda: _image(2, 4, 5, 6) + _image(2, 2, 10, 12),
    ),
    "up_nearest": (lambda: UpBlock("nearest"), lambda: _image(2, 4, 5, 6) + _image(2, 2, 10, 12)),
    "resize_bilinear": (lambda: Resize("bilinear", (7, 11)), lambda: _image(1, 3, 5, 8)),
    "resize_bilinear_corners": (
        lambda: Resize("bilinear", (9, 4), align_corners=True),
        lambda: _image(1, 3, 5, 8),
    ),
    "resize_nearest": (lambda: Resize("nearest", (7, 11)), lambda: _image(1, 3, 5, 8)),
    "adaptive_max": (AdaptiveMaxHead, lambda: _image(2, 3, 9, 7)),
    "conv3d": (Conv3dNet, lambda: _image(2, 2, 8, 6, 7)),
    "diagonal_repeat": (DiagonalRepeat, lambda: _image(2, 5, 4)),
}

# the ops each model's program keeps whole (inference)
KEPT = {
    "group_norm": {"aten.native_group_norm.default"},
    "up_bilinear": {"aten.upsample_bilinear2d.vec"},
    "up_nearest": {"aten.upsample_nearest2d.vec"},
    "adaptive_max": {"aten.adaptive_max_pool2d.default"},
    "conv3d": {
        "aten.max_pool3d_with_indices.default",
        "aten.avg_pool3d.default",
        "aten._adaptive_avg_pool3d.default",
    },
    "diagonal_repeat": {"aten.diagonal.default", "aten.repeat.default"},
}

# backward ops the joint graph keeps (group norm's and upsampling's backward are decomposed by
# core ATen; bilinear and nearest upsampling are then decomposed in the training forward too)
KEPT_TRAINING = {
    "adaptive_max": {"aten.adaptive_max_pool2d_backward.default"},
    "conv3d": {
        "aten.max_pool3d_with_indices_backward.default",
        "aten.avg_pool3d_backward.default",
        "aten._adaptive_avg_pool3d_backward.default",
    },
    "diagonal_repeat": {"aten.diagonal_scatter.default"},
}


def _build(name):
    torch.manual_seed(0)
    factory, inputs = MODELS[name]
    return factory().eval(), inputs()


@functools.cache
def _captured(name):
    """(model, inputs, inference capture) of MODELS[name], once per module for the tests that
    only read them."""
    model, inputs = _build(name)
    return model, inputs, portable.capture(model, inputs)


def _ops(program) -> set[str]:
    return {
        portable.opset.op_name(n.target) for n in program.graph.nodes if n.op == "call_function"
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_captured_whole_and_bit_for_bit_on_cpu(name):
    model, inputs, program = _captured(name)
    assert KEPT.get(name, set()) <= _ops(program)
    got = portable.compile(program, backend="cpu")(*inputs)
    want = model(*inputs)
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["xla", "onnx"])
@pytest.mark.parametrize("name", list(MODELS))
def test_inference_agrees_on_backends(name, backend):
    pytest.importorskip("jax" if backend == "xla" else "onnxruntime")
    model, inputs, program = _captured(name)  # the eager row compares the model too
    report = check_parity(program, inputs, backends=[backend], eager_model=model)
    assert report.ok, report.format()


class _Interpolate(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs

    def forward(self, x):
        return F.interpolate(x, **self.kwargs)


class _DiagonalRepeat(nn.Module):
    def forward(self, x):
        return torch.diagonal(x, 1, -2, -1).repeat(2, 1, 3)


# the ops alone (eager's bfloat16 convolution rounds differently from XLA's; avg_pool3d has no
# bfloat16 kernel in eager)
BFLOAT16 = {
    "group_norm": (lambda: nn.GroupNorm(4, 8), (2, 8, 5, 6)),
    "bilinear": (lambda: _Interpolate(scale_factor=2, mode="bilinear"), (2, 3, 5, 6)),
    "bilinear_large": (lambda: _Interpolate(size=(50, 90), mode="bilinear"), (1, 2, 20, 30)),
    "nearest": (lambda: _Interpolate(scale_factor=(1.5, 2.0)), (2, 3, 5, 6)),
    "adaptive_max": (lambda: nn.AdaptiveMaxPool2d((3, 4)), (2, 3, 7, 9)),
    "max_pool3d": (lambda: nn.MaxPool3d(2, padding=1), (2, 3, 5, 6, 7)),
    "adaptive_avg_pool3d": (lambda: nn.AdaptiveAvgPool3d((2, 3, 1)), (2, 3, 5, 6, 7)),
    "diagonal_repeat": (_DiagonalRepeat, (2, 4, 5)),
}


@pytest.mark.parametrize("name", list(BFLOAT16))
def test_bfloat16_inference_agrees_on_backends(name):
    pytest.importorskip("onnxruntime")
    factory, shape = BFLOAT16[name]
    torch.manual_seed(0)
    model, x = factory().to(torch.bfloat16), torch.randn(shape).to(torch.bfloat16)
    report = check_parity(model, (x,), backends=["xla", "onnx"])
    assert report.ok, report.format()


def _loss(model, *inputs):
    return model(*inputs).square().mean()


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_matches_eager_and_xla(name):
    model, inputs = _build(name)
    model.train()
    eager = copy.deepcopy(model)
    program = portable.capture(
        model, inputs, loss_fn=_loss, optimizer=portable.optim.SGD(lr=0.1, momentum=0.9)
    )
    assert KEPT_TRAINING.get(name, set()) <= _ops(program)
    report = check_parity(
        program, inputs, backends=["xla"], steps=3, eager_model=eager, loss_fn=_loss
    )
    assert report.ok, report.format()
    assert {r.backend for r in report.rows} == {"eager", "xla"}


def test_int64_max_pool3d_runs_on_every_backend():
    # MaxPool3d takes integer inputs in eager; ONNX Runtime's MaxPool has no int64 kernel, so
    # the onnx rule gathers the windows itself
    pytest.importorskip("onnxruntime")
    x = (torch.randn(2, 3, 6, 5, 7) * 4).round().long()  # ties: the first maximum wins
    model = nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True)
    report = check_parity(model, (x,), backends=["xla", "onnx"])
    assert report.ok, report.format()


def test_interpolate_scale_that_keeps_a_size_copies_that_dim():
    # scale_factor 1.1 keeps 5 rows: torch copies them (Resize with scale 1.1 would resample)
    class Model(nn.Module):
        def forward(self, x):
            return F.interpolate(x, scale_factor=(1.1, 1.3), mode="bilinear")

    x = torch.randn(1, 2, 5, 7)
    assert torch.equal(Model()(x)[..., :, 0], x[..., :, 0])
    report = check_parity(Model(), (x,), backends=["xla", "onnx"])
    assert report.ok, report.format()


_INT_CONVS = {
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=2, padding=1), (2, 4, 7, 8), (6, 4, 3, 3)),
    "conv2d_groups": (
        lambda x, w: F.conv2d(x, w, groups=2, padding=2, dilation=2),
        (2, 4, 7, 8),
        (6, 2, 3, 3),
    ),
    "conv1d": (lambda x, w: F.conv1d(x, w, stride=3), (2, 3, 11), (5, 3, 4)),
    "conv3d": (lambda x, w: F.conv3d(x, w, padding=1), (1, 2, 4, 5, 6), (3, 2, 3, 3, 2)),
    "conv_transpose2d": (
        lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
        (2, 4, 5, 6),
        (4, 3, 3, 3),
    ),
    "conv_transpose2d_groups": (
        lambda x, w: F.conv_transpose2d(x, w, stride=3, padding=2, groups=2, dilation=2),
        (2, 4, 5, 6),
        (4, 3, 3, 2),
    ),
    "conv_transpose3d": (
        lambda x, w: F.conv_transpose3d(
            x, w, stride=(1, 2, 2), padding=(0, 1, 1), output_padding=(0, 1, 0)
        ),
        (1, 2, 3, 4, 5),
        (2, 3, 2, 3, 3),
    ),
}


@pytest.mark.parametrize("name", sorted(_INT_CONVS))
def test_int64_convolution_is_exact_on_xla_and_refused_on_onnx(name):
    """Eager convolves int64 tensors (wrapping products, no rounding): so does xla, transposed
    convolutions too (JAX has no adjoint of an integer function: the rule writes the direct
    convolution); ONNX Runtime has no integer Conv and refuses before lowering."""
    fn, x_shape, w_shape = _INT_CONVS[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-9, 9, x_shape, generator=g)
    w = torch.randint(-9, 9, w_shape, generator=g)
    x.view(-1)[0] = 2**40  # beyond float64's exact integers once multiplied

    class Conv(nn.Module):
        def forward(self, x, w):
            return fn(x, w)

    program = portable.capture(Conv(), (x, w))
    want = fn(x, w)
    for backend in ("cpu", "xla"):
        got = portable.compile(program, backend=backend)(x, w)
        assert got.dtype == torch.int64 and torch.equal(got, want), backend
    with pytest.raises(LoweringError, match="no int64 Conv kernel"):
        portable.compile(program, backend="onnx")


_INT_POOLS = {
    "avg_pool1d": lambda x: F.avg_pool1d(x.flatten(2), 3, stride=2, padding=1),
    "avg_pool2d": lambda x: F.avg_pool2d(x, 2, stride=1, count_include_pad=False),
    "avg_pool2d_divisor": lambda x: F.avg_pool2d(x, 3, padding=1, divisor_override=2),
    "avg_pool3d": lambda x: F.avg_pool3d(x.unsqueeze(2).expand(-1, -1, 3, -1, -1), 2),
    "max_pool2d": lambda x: F.max_pool2d(x, 2, stride=1, padding=1),
    "local_response_norm": lambda x: F.local_response_norm(x, 2),
}


@pytest.mark.parametrize("name", sorted(_INT_POOLS))
def test_int64_pooling_truncates_as_eager(name):
    """torch's integer pools divide with C++'s truncating `/` (avg_pool1d of [-3, 0] is -1) and
    pad max pools with the dtype's lowest value: xla bit for bit; ONNX Runtime has no integer
    AveragePool / int64 MaxPool, refused before lowering."""
    fn = _INT_POOLS[name]
    x = torch.randint(-50, 50, (2, 3, 6, 7), generator=torch.Generator().manual_seed(0))

    class Pool(nn.Module):
        def forward(self, x):
            return fn(x)

    program = portable.capture(Pool(), (x,))
    want = fn(x)
    got = portable.compile(program, backend="cpu")(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if want.is_floating_point():  # local_response_norm: float math after the integer pool
        assert check_parity(program, (x,), backends=["xla"]).ok
    else:
        assert torch.equal(portable.compile(program, backend="xla")(x), want)
    with pytest.raises(LoweringError, match="int64"):
        portable.compile(program, backend="onnx")
